"""The JSON form of a sharding plan (``plan.json`` / ``frozen.json`` / the generated literal).

A plan document::

    {"format": 1,
     "mesh": {"axes": [...], "sizes": [...], "ep": N},
       (the device mesh's axes and sizes, and the expert-parallel size, whose ranks are
       borrowed from dp*cp: together every size the plan was made for)
     "applied_axes": ["tp"],
     "recorded_axes": {"cp": "<why not applied yet>", ...},
     "context_parallel": {"algorithm": "allgather_kv", "load_balance": true},
       (only where cp splits attention otherwise than gather_sequence: absent means that)
     "modules": {FQN_or_glob: ENTRY}}

and ENTRY as ``protocols.sharding_json`` writes and reads it (the one entry codec, which
``config_dict`` uses too): a full or compact object in ``plan.json``/``frozen.json``, one
line per key in the generated literal. Code that reads an entry's fields from a loaded
bundle goes through ``plan_entries``.

Everything here is torch-free: placements are text. ``ShardingConfig`` values that
hold torch placements are converted through ``placements`` (imported only then).
"""

from collections.abc import Mapping
from dataclasses import dataclass, field

from hyper_parallel.config.context_parallel import ContextParallel
from hyper_parallel.protocols.axes import DP, PP
from hyper_parallel.protocols.sharding import ShardingConfig
from hyper_parallel.protocols.sharding_json import (
    PlanFormatError,
    entry_role,
    full_entry,
    sharding_config_from_json,
    sharding_config_to_json,
)

PLAN_FORMAT_VERSION = 1
_DOC_KEYS = ("format", "mesh", "applied_axes", "recorded_axes", "modules")


@dataclass
class PlanDocument:
    mesh_axes: tuple[str, ...]
    mesh_sizes: tuple[int, ...]
    mesh_ep: int | None  # None: a plan written before the ep size was recorded
    applied_axes: list[str]
    recorded_axes: dict[str, str]
    modules: dict[str, ShardingConfig]
    roles: dict[str, str] = field(default_factory=dict)
    context_parallel: ContextParallel | None = None  # how attention is split over cp; None: no cp


def plan_modules_to_json(modules: Mapping[str, ShardingConfig], roles: Mapping[str, str] | None = None) -> dict:
    roles = roles or {}
    return {fqn: sharding_config_to_json(config, roles.get(fqn, "custom"), where=f"modules[{fqn!r}]")
            for fqn, config in modules.items()}


def plan_modules_from_json(modules: Mapping) -> dict[str, ShardingConfig]:
    if not isinstance(modules, Mapping):
        raise PlanFormatError(f"modules: expected an object keyed by module FQN, got {type(modules).__name__}")
    return {fqn: sharding_config_from_json(entry, where=f"modules[{fqn!r}]") for fqn, entry in modules.items()}


def plan_roles_from_json(modules: Mapping) -> dict[str, str]:
    return {fqn: entry_role(entry, where=f"modules[{fqn!r}]") for fqn, entry in modules.items()}


def plan_entries(plan: Mapping) -> dict[str, dict]:
    """A plan document's (or the generated literal's) entries as full JSON entries, whatever
    form they are written in: what preflight and verify read ``state_shardings`` from."""
    return {fqn: full_entry(entry, where=f"modules[{fqn!r}]") for fqn, entry in plan["modules"].items()}


def plan_to_json(*, mesh_axes, mesh_sizes, applied_axes, recorded_axes: Mapping[str, str],
                 modules: Mapping[str, ShardingConfig], roles: Mapping[str, str] | None = None,
                 context_parallel: ContextParallel | None = None, mesh_ep: int = 1) -> dict:
    return {
        "format": PLAN_FORMAT_VERSION,
        "mesh": {"axes": list(mesh_axes), "sizes": [int(s) for s in mesh_sizes], "ep": int(mesh_ep)},
        "applied_axes": list(applied_axes),
        "recorded_axes": {str(k): str(v) for k, v in sorted(recorded_axes.items())},
        **({"context_parallel": context_parallel.as_json()}
           if context_parallel is not None and context_parallel.algorithm != "gather_sequence" else {}),
        "modules": plan_modules_to_json(modules, roles),
    }


def plan_from_json(document: Mapping, *, where: str = "plan") -> PlanDocument:
    if not isinstance(document, Mapping):
        raise PlanFormatError(f"{where}: expected an object, got {type(document).__name__}")
    missing = [key for key in _DOC_KEYS if key not in document]
    if missing:
        raise PlanFormatError(f"{where}: missing keys {missing}")
    if document["format"] != PLAN_FORMAT_VERSION:
        raise PlanFormatError(f"{where}.format: expected {PLAN_FORMAT_VERSION}, got {document['format']!r}")
    mesh = document["mesh"]
    axes, sizes = tuple(mesh.get("axes", ())), tuple(mesh.get("sizes", ()))
    if len(axes) != len(sizes) or not all(isinstance(s, int) and s >= 1 for s in sizes):
        raise PlanFormatError(f"{where}.mesh: axes {list(axes)} and sizes {list(sizes)} do not pair up")
    ep = mesh.get("ep")
    if ep is not None and not (isinstance(ep, int) and not isinstance(ep, bool) and ep >= 1):
        raise PlanFormatError(f"{where}.mesh.ep: expected an integer >= 1, got {ep!r}")
    return PlanDocument(
        mesh_axes=axes,
        mesh_sizes=sizes,
        mesh_ep=ep,
        applied_axes=list(document["applied_axes"]),
        recorded_axes=dict(document["recorded_axes"]),
        modules=plan_modules_from_json(document["modules"]),
        roles=plan_roles_from_json(document["modules"]),
        context_parallel=_context_parallel(document, where),
    )


def _context_parallel(document: Mapping, where: str) -> ContextParallel | None:
    """The document's context parallel settings; a plan written before they existed
    (no key) split nothing but the sequence: gather_sequence."""
    data = document.get("context_parallel")
    if data is None:
        return None
    try:
        return ContextParallel.from_json(dict(data) if isinstance(data, Mapping) else data,
                                         where=f"{where}.context_parallel")
    except ValueError as exc:
        raise PlanFormatError(str(exc)) from None


# The recipe key behind each plan axis, for the warning about one that has no effect.
AXIS_KEYS = {"tp": "tp_size", "sp": "sequence_parallel", "cp": "cp_size", "ep": "ep_size",
             "loss_parallel": "loss_parallel"}


def unapplied_axis_warnings(recorded_axes: Mapping[str, str]) -> list[str]:
    """One line per axis the recipe asked for and the plan could place nothing on (dp and
    pp are the runtime's, never the plan's), naming the recipe key that has no effect.
    Derive logs them as warnings and so does every run that builds the model from the
    plan, so no front door hides them."""
    return [f"note: {axis} not applied: {why} (accelerator.{AXIS_KEYS.get(axis, axis)} has no effect on this "
            f"model; set it to its default to drop this warning)"
            for axis, why in sorted(recorded_axes.items()) if axis not in (DP, PP)]
