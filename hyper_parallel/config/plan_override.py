"""One recipe ``plan_overrides`` entry, parsed and validated once, when the recipe loads.

An entry is ``{match, module_type?, exact_type?, when?, replace_module?, params?,
in_src?, in_dst?, out_src?, out_dst?, local_map?}`` with placements written as text
(``replicate | partial | shard(N) | packed_shard(N,K)`` per mesh axis).

:func:`parse_plan_overrides` is the one place that checks an entry: its keys, their
types, ``when``, the ``replace_module`` target against the trusted packages, and every
placement. It returns frozen :class:`PlanOverride` objects; spec projection, derive, the
planner's merge and the emitter read their fields and check nothing again, so an error
always names the recipe key at fault and is raised before any stage runs.

torch-free, like the rest of the recipe loader (every up-to-date check loads the
recipe): placements are kept as ``PlacementSpec`` values, which the distributed layer
turns into torch placements when it merges an entry into a plan.
"""

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hyper_parallel.errors import HyperParallelError
from hyper_parallel.protocols.axes import OVERRIDE_AXES
from hyper_parallel.protocols.placement_text import (
    PlacementSpec,
    PlacementTextError,
    normalize_io_placements,
    normalize_named_placement,
    parse_placement_text,
)
from hyper_parallel.protocols.sharding import IO_PLACEMENT_FIELDS

# replace_module targets may always come from here; a recipe adds model.trusted_modules.
TRUSTED_PACKAGE = "hyper_parallel"
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
SELECT_KEYS = ("match", "module_type", "exact_type", "when", "replace_module")
PLACEMENT_KEYS = ("params", *IO_PLACEMENT_FIELDS, "local_map")
RECIPE_KEYS = SELECT_KEYS + PLACEMENT_KEYS

# ``{axis: placement}`` as (axis, placement) pairs in mesh order.
NamedPlacementSpec = tuple[tuple[str, PlacementSpec], ...]
# One named placement (or None: leave it alone) per positional input/output.
IOPlacementSpec = tuple[NamedPlacementSpec | None, ...] | None


class PlanOverrideError(ValueError, HyperParallelError):
    """A malformed plan_overrides entry; the message starts with its key path
    (``plan_overrides[2].replace_module._target_``), the loader adds the file."""


@dataclass(frozen=True)
class ReplaceModule:
    """``replace_module: {_target_: dotted.factory, **kwargs}``: the factory is called as
    ``factory(module, **kwargs)``; ``kwargs`` are sorted by name (deterministic output)."""

    target: str
    kwargs: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class PlanOverride:
    """One checked entry. ``index`` is its position in the recipe's list, so that every
    later message can name it; ``None`` for a key means the recipe left it out."""

    index: int
    match: str
    module_type: str | None = None
    exact_type: bool = False
    when: str | None = None
    replace_module: ReplaceModule | None = None
    params: tuple[tuple[str, NamedPlacementSpec], ...] | None = None
    in_src: IOPlacementSpec = None
    in_dst: IOPlacementSpec = None
    out_src: IOPlacementSpec = None
    out_dst: IOPlacementSpec = None
    local_map: bool | None = None

    @property
    def where(self) -> str:
        return f"plan_overrides[{self.index}]"

    @property
    def places(self) -> bool:
        """Whether the entry sets placements (else it only replaces a module, and the
        plan is derived from the new structure)."""
        return any(getattr(self, key) is not None for key in PLACEMENT_KEYS)

    def as_json(self) -> dict[str, Any]:
        """The entry as signatures hash it: every key, placements in canonical text,
        params sorted by name. The bundle signature covers this, so keys and order stay."""
        out: dict[str, Any] = {
            "match": self.match, "module_type": self.module_type, "exact_type": self.exact_type,
            "when": self.when,
            "replace_module": None if self.replace_module is None else {
                "target": self.replace_module.target, "kwargs": dict(self.replace_module.kwargs)},
            "params": None if self.params is None else {name: named_text(named) for name, named in self.params},
        }
        for key in IO_PLACEMENT_FIELDS:
            out[key] = io_text(getattr(self, key))
        out["local_map"] = self.local_map
        return out

    def replacement(self) -> dict[str, Any]:
        """The ``replace_module`` entry in the runtime's form (``hyper_apply_replacements``
        and the generated file's ``HYPER_REPLACEMENTS``); ``origin`` names the recipe key."""
        if self.replace_module is None:
            raise PlanOverrideError(f"{self.where} has no replace_module")
        return {"match": self.match, "module_type": self.module_type, "exact_type": self.exact_type,
                "target": self.replace_module.target, "kwargs": dict(self.replace_module.kwargs),
                "origin": f"{self.where}.replace_module._target_"}


def replacement_entries(overrides: Iterable[PlanOverride]) -> list[dict[str, Any]]:
    """The runtime form of every entry that replaces a module, in recipe order."""
    return [entry.replacement() for entry in overrides if entry.replace_module is not None]


def named_text(named: NamedPlacementSpec) -> dict[str, str]:
    return {axis: spec.text() for axis, spec in named}


def io_text(value: IOPlacementSpec) -> list[dict[str, str] | None] | None:
    return None if value is None else [None if named is None else named_text(named) for named in value]


# --- the one validation of an entry ---------------------------------------------------------

def parse_plan_overrides(data: Any, *, trusted: Sequence[str] = (TRUSTED_PACKAGE,)) -> tuple[PlanOverride, ...]:
    """The recipe's ``plan_overrides`` list, every entry checked; ``trusted``: the
    packages a ``replace_module._target_`` may come from. Raises PlanOverrideError."""
    if not isinstance(data, list):
        raise PlanOverrideError(f"plan_overrides: expected a list, got {type(data).__name__} {data!r}")
    return tuple(parse_plan_override(entry, index, trusted=trusted) for index, entry in enumerate(data))


def parse_plan_override(data: Any, index: int, *, trusted: Sequence[str] = (TRUSTED_PACKAGE,)) -> PlanOverride:
    """Entry ``index`` of the recipe's list, with every check an entry gets, here and only
    here: later stages read the fields as given and never check them again."""
    key = f"plan_overrides[{index}]"
    if not isinstance(data, dict):
        raise PlanOverrideError(f"{key}: expected a mapping, got {type(data).__name__} {data!r}")
    unknown = sorted((k for k in data if k not in RECIPE_KEYS), key=str)
    if unknown:
        raise PlanOverrideError(f"unknown key {f'{key}.{unknown[0]}'!r}; "
                                f"expected one of {', '.join(sorted(RECIPE_KEYS))}")
    if "match" not in data:
        raise PlanOverrideError(f"missing required key {f'{key}.match'!r}")
    try:
        return PlanOverride(
            index=index,
            match=_name(data["match"], f"{key}.match", "a module FQN or glob"),
            module_type=_optional(data, "module_type", key, lambda v, k: _name(v, k, "a dotted class path")),
            exact_type=_typed(data.get("exact_type", False), bool, f"{key}.exact_type"),
            when=_optional(data, "when", key, _when),
            replace_module=_optional(data, "replace_module", key, lambda v, k: _replace_module(v, k, trusted)),
            params=_optional(data, "params", key, _params),
            **{io: _optional(data, io, key, _io) for io in IO_PLACEMENT_FIELDS},
            local_map=_optional(data, "local_map", key, lambda v, k: _typed(v, bool, k)),
        )
    except PlacementTextError as exc:  # its message starts with the key path already
        raise PlanOverrideError(str(exc)) from None


def _optional(data: dict, name: str, key: str, parse) -> Any:
    """``parse(value, key path)`` for a key the entry gives a value; None (left out) else."""
    value = data.get(name)
    return None if value is None else parse(value, f"{key}.{name}")


def _typed(value: Any, kind: type, key: str) -> Any:
    if not isinstance(value, kind):
        raise PlanOverrideError(f"{key}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def _name(value: Any, key: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        got = f"{type(value).__name__} {value!r}" if not isinstance(value, str) else repr(value)
        raise PlanOverrideError(f"{key}: expected str ({what}), got {got}")
    return value


def _when(value: Any, key: str) -> str:
    if value not in OVERRIDE_AXES:
        raise PlanOverrideError(f"{key}: expected one of {', '.join(OVERRIDE_AXES)}, got {value!r}")
    return value


def _replace_module(value: Any, key: str, trusted: Sequence[str]) -> ReplaceModule:
    """The factory must come from a trusted package: no code runs that nobody opted into."""
    if not isinstance(value, dict) or not isinstance(value.get("_target_"), str):
        raise PlanOverrideError(f"{key}: expected a mapping with a string '_target_' "
                                f"(a dotted factory path), got {value!r}")
    target = value["_target_"]
    if not any(target.startswith(prefix + ".") for prefix in trusted):
        raise PlanOverrideError(f"{key}._target_: {target!r} is outside the trusted modules ({', '.join(trusted)}); "
                                f"if you trust its package, list it under model.trusted_modules")
    kwargs = {k: v for k, v in value.items() if k != "_target_"}
    odd = [k for k in kwargs if not isinstance(k, str)]
    if odd:
        raise PlanOverrideError(f"{key}: argument names must be strings (factory keyword arguments), got {odd[0]!r}")
    return ReplaceModule(target=target, kwargs=tuple(sorted(kwargs.items())))


def _params(value: Any, key: str) -> tuple[tuple[str, NamedPlacementSpec], ...]:
    if not isinstance(value, dict):
        raise PlanOverrideError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
    odd = [name for name in value if not isinstance(name, str)]
    if odd:
        raise PlanOverrideError(f"{key}: expected parameter names as keys, got {odd[0]!r}")
    return tuple((name, _named(named, f"{key}.{name}")) for name, named in sorted(value.items()))


def _named(value: Any, key: str) -> NamedPlacementSpec:
    canonical = normalize_named_placement(value, where=key)
    return tuple((axis, parse_placement_text(text)) for axis, text in canonical.items())


def _io(value: Any, key: str) -> IOPlacementSpec:
    canonical = normalize_io_placements(value, where=key)
    return tuple(None if named is None else _named(named, f"{key}[{i}]") for i, named in enumerate(canonical))


def trusted_packages(names: Iterable[Any]) -> tuple[str, ...]:
    """hyper_parallel and ``names`` (a recipe's model.trusted_modules), each checked to be
    a dotted module name; raises PlanOverrideError naming the bad one."""
    out = [TRUSTED_PACKAGE]
    for i, name in enumerate(names):
        if not isinstance(name, str) or not _DOTTED.fullmatch(name):
            raise PlanOverrideError(f"model.trusted_modules[{i}]: expected a dotted package or module name "
                                    f"(e.g. my_kernels.attention), got {name!r}")
        out.append(name)
    return tuple(out)


__all__ = ["OVERRIDE_AXES", "PLACEMENT_KEYS", "RECIPE_KEYS", "TRUSTED_PACKAGE", "IOPlacementSpec",
           "NamedPlacementSpec", "PlanOverride", "PlanOverrideError", "ReplaceModule", "io_text", "named_text",
           "parse_plan_override", "parse_plan_overrides", "replacement_entries", "trusted_packages"]
