"""Recipe ``plan_overrides`` merged into a derived plan.

An entry ``{match, module_type?, exact_type?, when?, replace_module?, params?, in_src?,
in_dst?, out_src?, out_dst?, local_map?}`` with placements as text:

- ``match`` is an exact module FQN or an fnmatch glob, matched by ``name_match``; it
  must hit some module;
- where entries overlap, the applier's precedence holds (``name_match``): an entry whose
  ``match`` names the module exactly wins over glob entries, wherever it stands in the
  list; among glob entries the later one wins (per key: each sets only what it gives);
- ``module_type`` (dotted class path, subclasses included) / ``exact_type`` narrow the hits;
- ``when: cp|ep|tp|sp`` skips the entry unless that parallel form is active;
- for a hit that has a derived entry, the keys given replace the derived ones
  (``params`` per parameter); a hit without one must be fully specified: ``params``
  for every direct parameter of the module;
- an entry without placement keys (e.g. only ``replace_module``) leaves the plan alone.
"""

import copy
from collections.abc import Iterable, Mapping

from torch import nn

from hyper_parallel.class_paths import class_paths
from hyper_parallel.distributed.name_match import in_precedence_order, names_matching
from hyper_parallel.distributed.plan_lint import PlanError
from hyper_parallel.protocols.placement_text import PlacementTextError
from hyper_parallel.protocols.placements import named_placement_from_text
from hyper_parallel.protocols.sharding import IO_PLACEMENT_FIELDS, ShardingConfig

_PLACEMENT_KEYS = ("params", *IO_PLACEMENT_FIELDS, "local_map")
_SELECT_KEYS = ("match", "module_type", "exact_type", "when", "replace_module")
_WHEN_VALUES = ("cp", "ep", "tp", "sp")


def merge_plan_overrides(modules: Mapping[str, ShardingConfig], overrides: Iterable[Mapping], model: nn.Module,
                         *, active_axes: Iterable[str] | None = None) -> dict[str, ShardingConfig]:
    """Return a new plan; ``active_axes`` (e.g. ``dims.active_axes(sequence_parallel=...)``)
    is needed only when some entry has ``when``."""
    merged = {fqn: copy.deepcopy(config) for fqn, config in modules.items()}
    placing = list(_placing_entries(overrides, model, active_axes))
    matches = [entry["match"] for entry, _, _ in placing]
    names = [name for name, _ in model.named_modules()]
    for index in in_precedence_order(matches, names):  # what wins is merged last
        entry, where, hits = placing[index]
        for fqn in hits:
            module = model.get_submodule(fqn)
            if fqn in merged:
                _merge_into(merged[fqn], entry, module, where, fqn)
            else:
                merged[fqn] = _fully_specified(entry, module, where, fqn)
    return merged


def overridden_modules(overrides: Iterable[Mapping], model: nn.Module, *,
                       active_axes: Iterable[str] | None = None) -> frozenset[str]:
    """FQNs that some active entry places (so the planner need not classify them itself)."""
    return frozenset(fqn for _, _, hits in _placing_entries(overrides, model, active_axes) for fqn in hits)


def _placing_entries(overrides, model: nn.Module, active_axes):
    """``(entry, where, hit FQNs)`` for each active entry that sets placements, checked."""
    active = None if active_axes is None else frozenset(active_axes)
    for index, entry in enumerate(overrides or ()):
        where = f"plan_overrides[{index}]"
        _check_keys(entry, where)
        if not _is_active(entry, active, where):
            continue
        if not any(key in entry for key in _PLACEMENT_KEYS):
            continue  # replace_module only: the structure changes, the plan is derived from it
        yield entry, where, _matching_modules(model, entry, where)


def _check_keys(entry, where: str) -> None:
    if not isinstance(entry, Mapping):
        raise PlanError(f"{where}: expected a mapping, got {type(entry).__name__}")
    unknown = sorted(set(entry) - set(_SELECT_KEYS) - set(_PLACEMENT_KEYS))
    if unknown:
        raise PlanError(f"{where}: unknown keys {unknown}; allowed: {sorted(_SELECT_KEYS + _PLACEMENT_KEYS)}")
    if not isinstance(entry.get("match"), str) or not entry["match"]:
        raise PlanError(f"{where}: 'match' must be a module FQN or glob, got {entry.get('match')!r}")


def _is_active(entry, active, where: str) -> bool:
    when = entry.get("when")
    if when is None:
        return True
    if when not in _WHEN_VALUES:
        raise PlanError(f"{where}: when={when!r}; expected one of {', '.join(_WHEN_VALUES)}")
    if active is None:
        raise PlanError(f"{where}: has when={when!r} but no active parallel forms were given to the merge")
    return when in active


def _matching_modules(model: nn.Module, entry, where: str) -> list[str]:
    pattern = entry["match"]
    names = [name for name, _ in model.named_modules()]
    hits = names_matching(pattern, names)
    if not hits:
        raise PlanError(f"{where}: match {pattern!r} hits no module of {type(model).__name__}")
    for key, test in (("module_type", _is_subclass_of), ("exact_type", _is_exactly)):
        if key in entry:
            typed = [n for n in hits if test(model.get_submodule(n), entry[key])]
            if not typed:
                found = sorted({_dotted(type(model.get_submodule(n))) for n in hits})
                raise PlanError(f"{where}: match {pattern!r} hits {len(hits)} module(s), none of "
                                f"{key} {entry[key]!r}; their types are {found}")
            hits = typed
    return hits


def _dotted(cls: type) -> str:
    return class_paths(cls)[0]


def _is_subclass_of(module: nn.Module, dotted: str) -> bool:
    return any(dotted in class_paths(cls) for cls in type(module).__mro__)


def _is_exactly(module: nn.Module, dotted: str) -> bool:
    return dotted in class_paths(type(module))


def _merge_into(config: ShardingConfig, entry, module: nn.Module, where: str, fqn: str) -> None:
    for name, named in _params(entry, module, where, fqn).items():
        config.state_shardings[name] = named
    for key in IO_PLACEMENT_FIELDS:
        if key in entry:
            setattr(config, key, _io(entry[key], f"{where}.{key}"))
    if "local_map" in entry:
        config.local_map = _local_map(entry, where)


def _fully_specified(entry, module: nn.Module, where: str, fqn: str) -> ShardingConfig:
    params = _params(entry, module, where, fqn)
    missing = [name for name, _ in module.named_parameters(recurse=False) if name not in params]
    if missing:
        raise PlanError(f"{where}: module {fqn!r} has no derived plan entry, so the override must be fully "
                        f"specified; 'params' lacks {missing}")
    config = ShardingConfig(state_shardings=params)
    for key in IO_PLACEMENT_FIELDS:
        setattr(config, key, _io(entry.get(key), f"{where}.{key}"))
    config.local_map = _local_map(entry, where) if "local_map" in entry else False
    return config


def _params(entry, module: nn.Module, where: str, fqn: str) -> dict:
    params = entry.get("params") or {}
    if not isinstance(params, Mapping):
        raise PlanError(f"{where}.params: expected {{parameter: {{axis: placement}}}}, got {params!r}")
    own = {name for name, _ in module.named_parameters(recurse=False)} | set(module._buffers)
    out = {}
    for name, named in params.items():
        if name not in own:
            raise PlanError(f"{where}.params: {name!r} is not a direct parameter of {fqn!r} "
                            f"({type(module).__name__}); it has {sorted(own)}")
        out[name] = _named(named, f"{where}.params.{name}")
    return out


def _named(named, where: str) -> dict:
    if not isinstance(named, Mapping):
        raise PlanError(f"{where}: expected a mapping of mesh axis to placement text, got {named!r}")
    try:
        return named_placement_from_text(named)
    except PlacementTextError as err:
        raise PlanError(f"{where}: {err}") from err


def _io(value, where: str):
    if value is None:
        return None
    if isinstance(value, Mapping):
        return (_named(value, f"{where}[0]"),)
    if isinstance(value, (list, tuple)):
        return tuple(None if item is None else _named(item, f"{where}[{i}]") for i, item in enumerate(value))
    raise PlanError(f"{where}: expected null, a named placement or a list of them, got {value!r}")


def _local_map(entry, where: str) -> bool:
    if not isinstance(entry["local_map"], bool):
        raise PlanError(f"{where}.local_map: expected true or false, got {entry['local_map']!r}")
    return entry["local_map"]
