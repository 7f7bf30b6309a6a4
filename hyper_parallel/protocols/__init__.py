"""The protocol layer: Module / Configurable / Function.Config / ShardingConfig.

Exports resolve lazily: importing ``hyper_parallel.protocols.sharding`` (torch-free,
used by the plan/freeze stages) must not pull torch in through this package.
"""

import importlib
from typing import Any

_EXPORTS = {
    "BaseModel": "hyper_parallel.protocols.module",
    "Module": "hyper_parallel.protocols.module",
    "collect_sharding_plan": "hyper_parallel.protocols.module",
    "Configurable": "hyper_parallel.protocols.configurable",
    "Function": "hyper_parallel.protocols.function",
    "IOPlacement": "hyper_parallel.protocols.sharding",
    "MeshAxisName": "hyper_parallel.protocols.sharding",
    "NamedPlacement": "hyper_parallel.protocols.sharding",
    "ShardingConfig": "hyper_parallel.protocols.sharding",
    "config_from_dict": "hyper_parallel.protocols.config_dict",
    "config_to_dict": "hyper_parallel.protocols.config_dict",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hyper_parallel.protocols' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
