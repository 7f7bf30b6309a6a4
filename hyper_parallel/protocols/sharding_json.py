"""One plan entry (a ``ShardingConfig`` with its role) as JSON, both ways: the one entry
codec. ``distributed.plan_format`` builds plan documents from it; ``config_dict`` (the
configs' round trip) writes and reads a ``ShardingConfig`` with it.

An ENTRY (written by ``sharding_config_to_json`` with every key, always in this order, so
``json.dumps`` without ``sort_keys`` is deterministic)::

    {"role": str,
     "state_shardings": {param: {axis: text}},
     "in_src": [named | null, ...] | null, "in_dst": ..., "out_src": ..., "out_dst": ...,
     "local_map": bool,
     "local_sizes": [attribute, ...], "local_slices": {param: [dim, [attribute, ...]]},
     "state_handoff": axis}

(the last three only where not empty: a module computed on this rank's heads whose own code
reshapes by its size attributes, ``ShardingConfig.local_sizes`` / ``local_slices``; a
recurrent block handing its state on along ``state_handoff``)

The compact form (``compact_entry``, what the generated file prints for a reviewer)
omits what a reader can infer: ``state_shardings`` when empty, ``in_src``/``out_src``
when null, ``in_dst``/``out_dst`` when equal to their ``*_src`` (no redistribution:
a ``*_dst`` that is written marks where one happens), ``local_map`` when false, and
writes a list of one named placement as that placement. The
reader applies the same defaults, so both forms decode to the same ``ShardingConfig``.

The line form (``entry_line``, what the generated plan literal holds: one line per
module key, so a reviewer reads a plan like torchtitan's) spells the compact form as
one string; the reader accepts it wherever it accepts an entry::

    LINE  := ROLE (" | " FIELD)*
    FIELD := PARAM ": " NAMED                 a state sharding, e.g. weight: tp=shard(0)
           | ("in" | "out") ": " IO [" -> " IO]    *_src, then *_dst where it differs
           | "local_map"
           | "local_sizes: " ATTR (" " ATTR)*      e.g. local_sizes: num_v_heads value_dim
           | "local_slices: " SLICE (" " SLICE)*
           | "state_handoff: " AXIS                 e.g. state_handoff: cp
    SLICE := PARAM "=" DIM "(" ATTR ("," ATTR)* ")"  e.g. conv1d.weight=0(key_dim,key_dim,value_dim)
    IO    := NAMED | "(" ITEM (", " ITEM)* ")" | "-"    per positional input/output; - none
    ITEM  := NAMED | "-"
    NAMED := AXIS "=" PLACEMENT (" " AXIS "=" PLACEMENT)* | "{}"

e.g. ``"rowwise | weight: tp=shard(1) | in: tp=shard(-1) | out: tp=partial | local_map"``.
An entry whose parameter is named like a field word (``in``, ``out``, ``local_map``)
stays a compact dict.

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

ENTRY_KEYS = ("role", "state_shardings", *IO_PLACEMENT_FIELDS, "local_map", "local_sizes", "local_slices",
              "state_handoff")
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
    if config.local_sizes:
        entry["local_sizes"] = _names(config.local_sizes, f"{where}.local_sizes")
    if config.local_slices:
        entry["local_slices"] = _slices(config.local_slices, f"{where}.local_slices")
    if config.state_handoff:
        entry["state_handoff"] = _axis(config.state_handoff, f"{where}.state_handoff")
    return entry


def _axis(value, where: str) -> str:
    """A mesh axis name (``state_handoff``'s)."""
    if not isinstance(value, str) or not value.isidentifier():
        raise PlanFormatError(f"{where}: expected a mesh axis name such as cp, got {value!r}")
    return str(value)


def _names(value, where: str) -> list[str]:
    """Attribute names, a packed block's a product of them (``n_groups*ssm_state_size``)."""
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(n, str) and all(part.isidentifier() for part in n.split("*")) for n in value):
        raise PlanFormatError(f"{where}: expected a list of attribute names, got {value!r}")
    return list(value)


def _slices(value, where: str) -> dict[str, list]:
    if not isinstance(value, Mapping):
        raise PlanFormatError(f"{where}: expected an object of parameter -> [dim, [attribute, ...]], got {value!r}")
    out = {}
    for name, spec in sorted(value.items()):
        if not (isinstance(spec, (list, tuple)) and len(spec) == 2 and type(spec[0]) is int and spec[0] >= 0):
            raise PlanFormatError(f"{where}.{name}: expected [dim, [attribute, ...]], got {spec!r}")
        out[str(name)] = [spec[0], _names(spec[1], f"{where}.{name}")]
    return out


def sharding_config_from_json(entry: Mapping | str, *, where: str = "entry") -> ShardingConfig:
    """An entry (any form: full, compact or line) -> ``ShardingConfig`` holding placement
    *text* (the applier accepts both)."""
    if isinstance(entry, str):
        entry = entry_from_line(entry, where=where)
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
        local_sizes=tuple(_names(entry.get("local_sizes") or [], f"{where}.local_sizes")),
        local_slices={name: (dim, tuple(blocks)) for name, (dim, blocks)
                      in _slices(entry.get("local_slices") or {}, f"{where}.local_slices").items()},
        state_handoff=_axis(entry["state_handoff"], f"{where}.state_handoff") if entry.get("state_handoff") else "",
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
    for key in ("local_sizes", "local_slices", "state_handoff"):
        if entry.get(key):
            out[key] = entry[key]
    return {key: out[key] for key in ENTRY_KEYS if key in out}


_FIELD_WORDS = ("in", "out", "local_map", "local_sizes", "local_slices", "state_handoff")
_IO_FIELDS = {"in": ("in_src", "in_dst"), "out": ("out_src", "out_dst")}


def entry_line(entry: Mapping) -> str | dict:
    """A full entry in the line form (module docstring), or its compact dict when a
    parameter's name is a field word; both decode to the same ``ShardingConfig``."""
    states = entry.get("state_shardings") or {}
    if any(name in _FIELD_WORDS or not _is_param_name(name) for name in states):
        return compact_entry(entry)
    fields = [entry["role"], *(f"{name}: {_named_text(named)}" for name, named in states.items())]
    for word, (src, dst) in _IO_FIELDS.items():
        src_value, dst_value = entry.get(src), entry.get(dst)
        if src_value is None and dst_value is None:
            continue
        text = f"{word}: {_io_text(src_value)}"
        fields.append(text if dst_value == src_value else f"{text} -> {_io_text(dst_value)}")
    if entry.get("local_map"):
        fields.append("local_map")
    if entry.get("local_sizes"):
        fields.append("local_sizes: " + " ".join(entry["local_sizes"]))
    if entry.get("local_slices"):
        fields.append("local_slices: " + " ".join(f"{name}={dim}({','.join(blocks)})"
                                                  for name, (dim, blocks) in entry["local_slices"].items()))
    if entry.get("state_handoff"):
        fields.append(f"state_handoff: {entry['state_handoff']}")
    return " | ".join(fields)


def _is_param_name(name: str) -> bool:
    """A parameter's name, a child's dotted (``conv1d.weight``)."""
    return all(part.isidentifier() for part in name.split("."))


def entry_from_line(text: str, *, where: str = "entry") -> dict:
    """The line form -> a full entry (``sharding_config_to_json``'s keys)."""
    role, *fields = [part.strip() for part in text.split("|")]
    if not role.isidentifier():
        raise PlanFormatError(f"{where}: {text!r} should start with a role name, got {role!r}")
    entry = {"role": role, "state_shardings": {}, "in_src": None, "in_dst": None, "out_src": None,
             "out_dst": None, "local_map": False}
    seen = set()
    for field in fields:
        name, colon, value = (field, "", "") if field == "local_map" else field.partition(":")
        name, value = name.strip(), value.strip()
        if name in seen or (name != "local_map" and not colon) or not _is_param_name(name):
            problem = "repeats" if name in seen else "is not NAME: VALUE or local_map"
            raise PlanFormatError(f"{where}: field {field!r} {problem} (in {text!r})")
        seen.add(name)
        if name == "local_map":
            entry["local_map"] = True
        elif name == "local_sizes":
            entry["local_sizes"] = value.split()
        elif name == "local_slices":
            entry["local_slices"] = _slices_from_text(value, f"{where}.local_slices")
        elif name == "state_handoff":
            entry["state_handoff"] = _axis(value, f"{where}.state_handoff")
        elif name in _IO_FIELDS:
            src, arrow, dst = value.partition("->")
            src_key, dst_key = _IO_FIELDS[name]
            entry[src_key] = _io_from_text(src.strip(), f"{where}.{src_key}")
            entry[dst_key] = _io_from_text(dst.strip(), f"{where}.{dst_key}") if arrow else entry[src_key]
        else:
            entry["state_shardings"][name] = _named_from_text(value, f"{where}.state_shardings.{name}")
    return entry


def full_entry(entry: Mapping | str, *, where: str = "entry") -> dict:
    """Any form of an entry as the full JSON entry: what code reading an entry's fields
    (``role``, ``state_shardings``) from a generated plan literal goes through."""
    return sharding_config_to_json(sharding_config_from_json(entry, where=where),
                                   entry_role(entry, where=where), where=where)


def entry_role(entry: Mapping | str, *, where: str = "entry") -> str:
    """The role of an entry in any form (a line starts with it)."""
    if isinstance(entry, str):
        return entry.split("|", 1)[0].strip()
    if not isinstance(entry, Mapping):
        raise PlanFormatError(f"{where}: expected an object or a line, got {type(entry).__name__}")
    return str(entry.get("role", "custom"))


def _named_text(named: Mapping[str, str]) -> str:
    return " ".join(f"{axis}={text}" for axis, text in named.items()) or "{}"


def _io_text(value) -> str:
    if value is None:
        return "-"
    if len(value) == 1 and value[0] is not None:
        return _named_text(value[0])
    return "(" + ", ".join("-" if item is None else _named_text(item) for item in value) + ")"


def _named_from_text(text: str, where: str) -> dict[str, str]:
    if text == "{}":
        return {}
    named = {}
    for part in text.split():
        axis, equals, placement = part.partition("=")
        if not equals or axis in named:
            raise PlanFormatError(f"{where}: expected AXIS=PLACEMENT pairs (tp=shard(0) cp=replicate), got {text!r}")
        named[axis] = placement
    return _named_to_json(named, where)


def _io_from_text(text: str, where: str):
    if text == "-":
        return None
    if not (text.startswith("(") and text.endswith(")")):
        return [_named_from_text(text, where)]
    items = _split_top_level(text[1:-1])
    return [None if item == "-" else _named_from_text(item, f"{where}[{i}]") for i, item in enumerate(items)]


def _slices_from_text(text: str, where: str) -> dict[str, list]:
    """``conv1d.weight=0(key_dim,key_dim,value_dim) ...`` -> {param: [dim, [attribute, ...]]}."""
    out = {}
    for item in text.split():
        name, equals, spec = item.partition("=")
        dim, paren, blocks = spec.partition("(")
        if not equals or not paren or not blocks.endswith(")") or not dim.isdigit():
            raise PlanFormatError(f"{where}: expected PARAM=DIM(ATTR,...) items, got {item!r}")
        out[name] = [int(dim), blocks[:-1].split(",")]
    return out


def _split_top_level(text: str) -> list[str]:
    """``a, b(1,2) c, -`` -> its comma-separated items, ignoring commas inside parentheses
    (``packed_shard(1,2)``)."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    return items + [text[start:].strip()]


def _bool(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise PlanFormatError(f"{where}: expected true or false, got {value!r}")
    return value
