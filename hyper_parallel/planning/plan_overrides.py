"""Recipe ``plan_overrides`` merged into a derived plan.

The entries arrive as ``PlanOverride`` objects, checked when the recipe was loaded
(``hyper_parallel.config.plan_override``, which also documents their keys); what is left
to check here needs the model:

- ``match`` is an exact module FQN or an fnmatch glob, matched by ``name_match``; it
  must hit some module;
- where entries overlap, the applier's precedence holds (``name_match``): an entry whose
  ``match`` names the module exactly wins over glob entries, wherever it stands in the
  list; among glob entries the later one wins (per key: each sets only what it gives);
- ``module_type`` (dotted class path, subclasses included unless ``exact_type``) narrows
  the hits; a ``replace_module`` entry's ``module_type`` names the module it replaces,
  not the replacement the planner sees, so it does not narrow here;
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
from hyper_parallel.config.plan_override import IOPlacementSpec, NamedPlacementSpec, PlanOverride
from hyper_parallel.distributed.name_match import in_precedence_order, names_matching
from hyper_parallel.planning.plan_lint import PlanError
from hyper_parallel.protocols.placements import placement_from_spec
from hyper_parallel.protocols.sharding import IO_PLACEMENT_FIELDS, ShardingConfig


def merge_plan_overrides(modules: Mapping[str, ShardingConfig], overrides: Iterable[PlanOverride], model: nn.Module,
                         *, active_axes: Iterable[str] | None = None) -> dict[str, ShardingConfig]:
    """Return a new plan; ``active_axes`` (e.g. ``dims.active_axes(sequence_parallel=...)``)
    is needed only when some entry has ``when``."""
    merged = {fqn: copy.deepcopy(config) for fqn, config in modules.items()}
    placing = list(_placing_entries(overrides, model, active_axes))
    matches = [entry.match for entry, _ in placing]
    names = [name for name, _ in model.named_modules()]
    for index in in_precedence_order(matches, names):  # what wins is merged last
        entry, hits = placing[index]
        for fqn in hits:
            module = model.get_submodule(fqn)
            if fqn in merged:
                _merge_into(merged[fqn], entry, module, fqn)
            else:
                merged[fqn] = _fully_specified(entry, module, fqn)
    return merged


def overridden_modules(overrides: Iterable[PlanOverride], model: nn.Module, *,
                       active_axes: Iterable[str] | None = None) -> frozenset[str]:
    """FQNs that some active entry places (so the planner need not classify them itself)."""
    return frozenset(fqn for _, hits in _placing_entries(overrides, model, active_axes) for fqn in hits)


def _placing_entries(overrides: Iterable[PlanOverride], model: nn.Module, active_axes):
    """``(entry, hit FQNs)`` for each active entry that sets placements."""
    active = None if active_axes is None else frozenset(active_axes)
    for entry in overrides or ():
        if not _is_active(entry, active):
            continue
        if not entry.places:
            continue  # replace_module only: the structure changes, the plan is derived from it
        yield entry, _matching_modules(model, entry)


def _is_active(entry: PlanOverride, active) -> bool:
    if entry.when is None:
        return True
    if active is None:
        raise PlanError(f"{entry.where}: has when={entry.when!r} but no active parallel forms were given to the merge")
    return entry.when in active


def _matching_modules(model: nn.Module, entry: PlanOverride) -> list[str]:
    names = [name for name, _ in model.named_modules()]
    hits = names_matching(entry.match, names)
    if not hits:
        raise PlanError(f"{entry.where}: match {entry.match!r} hits no module of {type(model).__name__}")
    module_type = None if entry.replace_module is not None else entry.module_type
    if module_type is None:
        return hits
    test = _is_exactly if entry.exact_type else _is_subclass_of
    typed = [n for n in hits if test(model.get_submodule(n), module_type)]
    if not typed:
        found = sorted({_dotted(type(model.get_submodule(n))) for n in hits})
        exactly = "exact " if entry.exact_type else ""
        raise PlanError(f"{entry.where}: match {entry.match!r} hits {len(hits)} module(s), none of "
                        f"{exactly}module_type {module_type!r}; their types are {found}")
    return typed


def _dotted(cls: type) -> str:
    return class_paths(cls)[0]


def _is_subclass_of(module: nn.Module, dotted: str) -> bool:
    return any(dotted in class_paths(cls) for cls in type(module).__mro__)


def _is_exactly(module: nn.Module, dotted: str) -> bool:
    return dotted in class_paths(type(module))


def _merge_into(config: ShardingConfig, entry: PlanOverride, module: nn.Module, fqn: str) -> None:
    for name, named in _params(entry, module, fqn).items():
        config.state_shardings[name] = named
    for key in IO_PLACEMENT_FIELDS:
        if getattr(entry, key) is not None:
            setattr(config, key, _io(getattr(entry, key)))
    if entry.local_map is not None:
        config.local_map = entry.local_map


def _fully_specified(entry: PlanOverride, module: nn.Module, fqn: str) -> ShardingConfig:
    params = _params(entry, module, fqn)
    missing = [name for name, _ in module.named_parameters(recurse=False) if name not in params]
    if missing:
        raise PlanError(f"{entry.where}: module {fqn!r} has no derived plan entry, so the override must be fully "
                        f"specified; 'params' lacks {missing}")
    config = ShardingConfig(state_shardings=params)
    for key in IO_PLACEMENT_FIELDS:
        setattr(config, key, _io(getattr(entry, key)))
    config.local_map = bool(entry.local_map)
    return config


def _params(entry: PlanOverride, module: nn.Module, fqn: str) -> dict:
    """The entry's params as torch placements; each must be the module's own parameter or
    buffer (what the recipe could not know before the model was built)."""
    own = {name for name, _ in module.named_parameters(recurse=False)} | set(module._buffers)
    out = {}
    for name, named in entry.params or ():
        if name not in own:
            raise PlanError(f"{entry.where}.params: {name!r} is not a direct parameter of {fqn!r} "
                            f"({type(module).__name__}); it has {sorted(own)}")
        out[name] = _named(named)
    return out


def _named(named: NamedPlacementSpec) -> dict:
    return {axis: placement_from_spec(spec) for axis, spec in named}


def _io(value: IOPlacementSpec):
    return None if value is None else tuple(None if named is None else _named(named) for named in value)
