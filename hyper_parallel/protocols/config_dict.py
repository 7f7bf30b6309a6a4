"""Configs ↔ plain dicts (JSON-compatible), so that a model is data that round-trips.

Every config becomes ``{"_target_": "module:Qualname.Config", field: value, ...}``;
``Function.Config`` stores its function as ``"module:qualname"``; a ``ShardingConfig``
stores placements in the project's text grammar (``replicate | partial | shard(N) |
packed_shard(N,K)``, see ``hyper_parallel.distributed.placement_text``).
"""

import dataclasses
import importlib
from typing import Any

from hyper_parallel.distributed.placements import placement_from_text, placement_to_text
from hyper_parallel.protocols.configurable import Configurable
from hyper_parallel.protocols.function import Function
from hyper_parallel.protocols.sharding import IO_PLACEMENT_FIELDS, MeshAxisName, ShardingConfig

TARGET = "_target_"


def config_to_dict(config: Any) -> dict:
    if isinstance(config, ShardingConfig):
        return _sharding_to_dict(config)
    if isinstance(config, Function.Config):
        return {TARGET: _path_of(type(config)), "fn": _path_of(config.fn),
                "kwargs": _value_to_data(config.kwargs, "Function.Config.kwargs")}
    if not isinstance(config, Configurable.Config):
        raise TypeError(f"config_to_dict: expected a Config dataclass, got {type(config).__qualname__}")
    out: dict = {TARGET: _path_of(type(config))}
    for f in dataclasses.fields(config):
        out[f.name] = _value_to_data(getattr(config, f.name), f"{type(config).__qualname__}.{f.name}")
    return out


def config_from_dict(data: dict) -> Any:
    if not isinstance(data, dict) or TARGET not in data:
        raise ValueError(f"config_from_dict: expected a dict with a {TARGET!r} key, got {data!r:.200}")
    cls = _import_path(data[TARGET])
    fields = {k: v for k, v in data.items() if k != TARGET}
    if cls is ShardingConfig:
        return _sharding_from_dict(fields)
    if issubclass(cls, Function.Config):
        return cls(fn=_import_path(fields["fn"]), kwargs=_value_from_data(fields.get("kwargs", {})))
    return cls(**{k: _value_from_data(v) for k, v in fields.items()})


def _value_to_data(value: Any, where: str) -> Any:
    if isinstance(value, (Configurable.Config, ShardingConfig)):
        return config_to_dict(value)
    if isinstance(value, (list, tuple)):
        return [_value_to_data(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _value_to_data(v, where) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{where}: cannot serialize a {type(value).__qualname__} ({value!r:.100})")


def _value_from_data(value: Any) -> Any:
    if isinstance(value, dict):
        if TARGET in value:
            return config_from_dict(value)
        return {k: _value_from_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_value_from_data(v) for v in value]
    return value


def _path_of(obj: Any) -> str:
    return f"{obj.__module__}:{obj.__qualname__}"


def _import_path(path: str) -> Any:
    module_name, _, qualname = path.partition(":")
    if not qualname:
        raise ValueError(f"expected 'module:qualname', got {path!r}")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# --- ShardingConfig -------------------------------------------------------------------

def _sharding_to_dict(config: ShardingConfig) -> dict:
    out: dict = {TARGET: _path_of(ShardingConfig),
                 "state_shardings": {name: _named_to_text(named)
                                     for name, named in config.state_shardings.items()}}
    for name in IO_PLACEMENT_FIELDS:
        out[name] = _io_to_text(getattr(config, name))
    out["local_map"] = config.local_map
    return out


def _sharding_from_dict(fields: dict) -> ShardingConfig:
    return ShardingConfig(
        state_shardings={name: _named_from_text(named)
                         for name, named in fields.get("state_shardings", {}).items()},
        **{name: _io_from_text(fields.get(name)) for name in IO_PLACEMENT_FIELDS},
        local_map=bool(fields.get("local_map", False)),
    )


def _io_to_text(io: Any) -> Any:
    if io is None:
        return None
    if isinstance(io, tuple):
        return [None if named is None else _named_to_text(named) for named in io]
    return _named_to_text(io)


def _io_from_text(io: Any) -> Any:
    if io is None:
        return None
    if isinstance(io, list):
        return tuple(None if named is None else _named_from_text(named) for named in io)
    return _named_from_text(io)


def _named_to_text(named: dict) -> dict[str, str]:
    return {str(axis): placement_to_text(p) for axis, p in named.items()}


def _named_from_text(named: dict) -> dict:
    return {_axis(axis): placement_from_text(text) for axis, text in named.items()}


def _axis(name: str) -> Any:
    try:
        return MeshAxisName(name)
    except ValueError:
        return name
