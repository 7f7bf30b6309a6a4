"""Linear: the backend's linear layer, built from a Config."""

from dataclasses import dataclass, field

from hyper_parallel import platform
from hyper_parallel.models.common.param_init import kaiming_uniform_, zeros_
from hyper_parallel.protocols import Function, Module


class Linear(platform.Linear, Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        in_features: int
        out_features: int
        bias: bool = True
        # weight init; the bias (if any) starts at zero
        _param_init: Function.Config = field(
            default_factory=lambda: Function.Config(fn=kaiming_uniform_))

    def __init__(self, config: "Linear.Config"):
        platform.Linear.__init__(self, config.in_features, config.out_features, bias=config.bias)
        Module.__init__(self, config)

    def _init_self_params(self) -> None:
        self.config._param_init(self.weight)
        if self.bias is not None:
            zeros_(self.bias)
