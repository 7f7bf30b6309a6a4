"""Configs ↔ plain dicts (JSON-compatible), so that a model is data that round-trips.

Every config becomes ``{"_target_": "module:Qualname.Config", field: value, ...}``;
``Function.Config`` stores its function as ``"module:qualname"``; a ``ShardingConfig``
stores placements in the project's text grammar (``replicate | partial | shard(N) |
packed_shard(N,K)``, see ``hyper_parallel.protocols.placement_text``).

Each config class writes and reads its own fields (``Configurable.Config._fields_to_data``
and ``_from_data_fields``; ``Function.Config`` overrides both); this module holds the
``_target_`` envelope, plain values and ``ShardingConfig``. It imports no config class
but ``ShardingConfig``, so that ``Configurable`` (whose ``to_dict``/``from_dict`` call it)
and ``Function`` sit above it without an import cycle.
"""

import importlib
from collections.abc import Mapping
from typing import Any

from hyper_parallel.protocols.placements import placement_from_text
from hyper_parallel.protocols.sharding import IO_PLACEMENT_FIELDS, MeshAxisName, ShardingConfig
from hyper_parallel.protocols.sharding_json import sharding_config_from_json, sharding_config_to_json

TARGET = "_target_"


def config_to_dict(config: Any) -> dict:
    if isinstance(config, ShardingConfig):
        return _sharding_to_dict(config)
    if not _is_config(config):
        raise TypeError(f"config_to_dict: expected a Config dataclass, got {type(config).__qualname__}")
    return {TARGET: path_of(type(config)), **config._fields_to_data()}


def config_from_dict(data: dict) -> Any:
    if not isinstance(data, dict) or TARGET not in data:
        raise ValueError(f"config_from_dict: expected a dict with a {TARGET!r} key, got {data!r:.200}")
    cls = import_path(data[TARGET])
    fields = {k: v for k, v in data.items() if k != TARGET}
    if cls is ShardingConfig:
        return _sharding_from_dict(fields)
    from_data_fields = getattr(cls, "_from_data_fields", None)
    if from_data_fields is not None:
        return from_data_fields(fields)
    return cls(**{k: value_from_data(v) for k, v in fields.items()})


def _is_config(value: Any) -> bool:
    """A ``Configurable.Config`` instance, recognized by the hook it defines rather than by
    its class, which this module cannot import (``Configurable`` imports this module)."""
    return not isinstance(value, type) and hasattr(type(value), "_fields_to_data")


def value_to_data(value: Any, where: str) -> Any:
    """A config field's value as plain data: nested configs as dicts, sequences as lists."""
    if isinstance(value, ShardingConfig) or _is_config(value):
        return config_to_dict(value)
    if isinstance(value, (list, tuple)):
        return [value_to_data(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): value_to_data(v, where) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{where}: cannot serialize a {type(value).__qualname__} ({value!r:.100})")


def value_from_data(value: Any) -> Any:
    """The inverse of ``value_to_data``: a dict with a ``_target_`` becomes its config."""
    if isinstance(value, dict):
        if TARGET in value:
            return config_from_dict(value)
        return {k: value_from_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [value_from_data(v) for v in value]
    return value


def path_of(obj: Any) -> str:
    """``module:qualname``, the spelling ``import_path`` reads back."""
    return f"{obj.__module__}:{obj.__qualname__}"


def import_path(path: str) -> Any:
    """The object a ``module:qualname`` path names."""
    module_name, _, qualname = path.partition(":")
    if not qualname:
        raise ValueError(f"expected 'module:qualname', got {path!r}")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# --- ShardingConfig -------------------------------------------------------------------

def _sharding_to_dict(config: ShardingConfig) -> dict:
    """The entry codec's JSON (``sharding_json``), without the plan's ``role``; an input or
    output given as one mapping (not a tuple) stays one, so the config round-trips equal."""
    entry = sharding_config_to_json(config, where="ShardingConfig")
    del entry["role"]
    for name in IO_PLACEMENT_FIELDS:
        if isinstance(getattr(config, name), Mapping):
            entry[name] = entry[name][0]
    return {TARGET: path_of(ShardingConfig), **entry}


def _sharding_from_dict(fields: dict) -> ShardingConfig:
    """Read by the entry codec, then typed back: mesh axes as ``MeshAxisName`` where they
    are one, placements as torch placements (what the config held before ``to_dict``)."""
    text = sharding_config_from_json(fields, where="ShardingConfig")
    return ShardingConfig(
        state_shardings={name: _named_from_text(named) for name, named in text.state_shardings.items()},
        **{name: _io_from_text(getattr(text, name), single=isinstance(fields.get(name), Mapping))
           for name in IO_PLACEMENT_FIELDS},
        local_map=text.local_map,
        local_sizes=text.local_sizes,
        local_slices=text.local_slices,
        state_handoff=text.state_handoff,
    )


def _io_from_text(io: Any, *, single: bool) -> Any:
    if io is None:
        return None
    if single:
        return _named_from_text(io[0])
    return tuple(None if named is None else _named_from_text(named) for named in io)


def _named_from_text(named: dict) -> dict:
    return {_axis(axis): placement_from_text(text) for axis, text in named.items()}


def _axis(name: str) -> Any:
    try:
        return MeshAxisName(name)
    except ValueError:
        return name
