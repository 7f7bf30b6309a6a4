"""One plan entry (a ``ShardingConfig`` with its role) as JSON, both ways: the one entry
codec. ``distributed.plan_format`` builds plan documents from it; ``config_dict`` (the
M1 configs' round trip) writes and reads a ``ShardingConfig`` with it.

An ENTRY (written by ``sharding_config_to_json`` with every key, always in this order, so
``json.dumps`` without ``sort_keys`` is deterministic)::

    {"role": str,
     "state_shardings": {param: {axis: text}},
     "in_src": [named | null, ...] | null, "in_dst": ..., "out_src": ..., "out_dst": ...,
     "local_map": bool}

The compact form (``compact_entry``, what the generated file prints for a reviewer)
omits what a reader can infer: ``state_shardings`` when empty, ``in_src``/``out_src``
when null, ``in_dst``/``out_dst`` when equal to their ``*_src`` (no redistribution:
a ``*_dst`` that is written marks where one happens), ``local_map`` when false, and
writes a list of one named placement as that placement. The
reader applies the same defaults, so both forms decode to the same ``ShardingConfig``.

Placements are text here; a ``ShardingConfig`` holding torch placements is converted
through ``placements`` (torch is imported only then).
"""

from collections.abc import Mapping

from hyper_parallel.errors import HyperParallelError
from hyper_parallel.protocols.placement_text import (
    PlacementTextError,
    normalize_named_placement,
    parse_placement_text,
)
from hyper_parallel.protocols.sharding import IO_PLACEMENT_FIELDS, ShardingConfig

ENTRY_KEYS = ("role", "state_shardings", *IO_PLACEMENT_FIELDS, "local_map")
_SRC_OF = {"in_dst": "in_src", "out_dst": "out_src"}  # an omitted *_dst is its *_src


class PlanFormatError(ValueError, HyperParallelError):
    """A plan document or entry that does not have the expected shape."""


def _text(placement) -> str:
    if isinstance(placement, str):
        return parse_placement_text(placement).text()
    from hyper_parallel.protocols.placements import placement_to_text  # torch only when needed

    return placement_to_text(placement)


def _named_to_json(named, where: str) -> dict[str, str]:
    if not isinstance(named, Mapping):
        raise PlanFormatError(f"{where}: expected a mapping of mesh axis to placement, got {named!r}")
    try:
        return normalize_named_placement({str(axis): _text(p) for axis, p in named.items()}, where=where)
    except PlacementTextError as err:
        message = str(err)
        raise PlanFormatError(message if message.startswith(where) else f"{where}: {message}") from err


def _io_to_json(value, where: str):
    if value is None:
        return None
    if isinstance(value, Mapping):  # a single named placement means "the first input/output"
        return [_named_to_json(value, f"{where}[0]")]
    if isinstance(value, (list, tuple)):
        return [None if item is None else _named_to_json(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise PlanFormatError(f"{where}: expected null, a named placement or a list of them, got {value!r}")


def sharding_config_to_json(config: ShardingConfig, role: str = "custom", *, where: str = "entry") -> dict:
    states = {name: _named_to_json(named, f"{where}.state_shardings.{name}")
              for name, named in sorted(config.state_shardings.items())}
    entry = {"role": role, "state_shardings": states}
    for key in IO_PLACEMENT_FIELDS:
        entry[key] = _io_to_json(getattr(config, key), f"{where}.{key}")
    entry["local_map"] = bool(config.local_map)
    return entry


def sharding_config_from_json(entry: Mapping, *, where: str = "entry") -> ShardingConfig:
    """An entry -> ``ShardingConfig`` holding placement *text* (the applier accepts both)."""
    if not isinstance(entry, Mapping):
        raise PlanFormatError(f"{where}: expected an object, got {type(entry).__name__}")
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise PlanFormatError(f"{where}: unknown keys {unknown}; expected {list(ENTRY_KEYS)}")
    states = entry.get("state_shardings") or {}
    if not isinstance(states, Mapping):
        raise PlanFormatError(f"{where}.state_shardings: expected an object, got {states!r}")
    config = ShardingConfig(
        state_shardings={name: _named_to_json(named, f"{where}.state_shardings.{name}")
                         for name, named in states.items()},
        local_map=_bool(entry.get("local_map", False), f"{where}.local_map"),
    )
    for key in IO_PLACEMENT_FIELDS:
        io = _io_to_json(entry.get(key, entry.get(_SRC_OF.get(key, ""))), f"{where}.{key}")
        setattr(config, key, None if io is None else tuple(io))
    return config


def _single_io(value):
    """A list of one named placement as that placement (the reader's "first input/output")."""
    return value[0] if isinstance(value, list) and len(value) == 1 and value[0] is not None else value


def compact_entry(entry: Mapping) -> dict:
    """A full entry (``sharding_config_to_json``'s) without the keys the reader infers
    (module docstring): same decoded ``ShardingConfig``, fewer lines to review."""
    out = {"role": entry["role"]}
    if entry.get("state_shardings"):
        out["state_shardings"] = entry["state_shardings"]
    for dst, src in _SRC_OF.items():
        if entry.get(src) is not None:
            out[src] = _single_io(entry[src])
        if entry.get(dst) != entry.get(src):
            out[dst] = _single_io(entry.get(dst))
    if entry.get("local_map"):
        out["local_map"] = True
    return {key: out[key] for key in ENTRY_KEYS if key in out}


def _bool(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise PlanFormatError(f"{where}: expected true or false, got {value!r}")
    return value
