"""Module: a backend module built from its ``Config``, with explicit state initialization.

Construction only allocates (possibly on the meta device); ``init_states`` fills the
values afterwards, module by module in ``modules()`` order, so that the same seed gives
the same parameters however the model was built:

- parameters through ``Config._param_init`` (a ``Function.Config``) in
  ``_init_self_params``; a component with several kinds of parameters overrides it;
- non-persistent buffers (caches derived from the config, e.g. RoPE's cos/sin) in
  ``_init_self_buffers(buffer_device)``.

``Config.sharding_config`` is where the declarative sharding helpers write the module's
plan; components never read it (no parallel code in components).
"""

from dataclasses import dataclass
from typing import Any

import torch

from hyper_parallel import platform
from hyper_parallel.protocols.configurable import Configurable
from hyper_parallel.protocols.function import Function
from hyper_parallel.protocols.sharding import ShardingConfig


class Module(platform.Module, Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        sharding_config: ShardingConfig | None = None
        _param_init: Function.Config | None = None

    def __init__(self, config: "Module.Config | None" = None) -> None:
        # Components also inherit a backend class (platform.Linear) whose __init__ calls
        # super().__init__() without arguments and lands here: only the backend part is
        # initialized then, and the component calls Module.__init__(self, config) itself.
        if "_modules" not in self.__dict__:
            platform.Module.__init__(self)
        if config is not None:
            Configurable.__init__(self, config)

    def init_states(self, *, buffer_device: Any = None) -> None:
        """Initialize every parameter and rebuild every derived buffer of this subtree."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, Module):
                    module._init_self_params()
                    module._init_self_buffers(buffer_device)

    def _init_self_params(self) -> None:
        param_init = self.config._param_init
        if param_init is None:
            return
        for param in self.parameters(recurse=False):
            param_init(param)

    def _init_self_buffers(self, buffer_device: Any) -> None:
        """Rebuild buffers derived from the config (none by default)."""


class BaseModel(Module):
    """A top-level model: the root of a ``Config`` tree and of ``init_states``."""


def collect_sharding_plan(model: platform.Module) -> dict[str, ShardingConfig]:
    """``{fqn: sharding_config}`` of every ``Module`` in ``model`` whose config has one:
    the plan the applier takes (``apply_sharding_plan(model, plan, mesh)``)."""
    return {fqn: module.config.sharding_config for fqn, module in model.named_modules()
            if isinstance(module, Module) and module.config.sharding_config is not None}
