"""The JSON form of a sharding plan (``plan.json`` / ``frozen.json`` / the generated literal).

A plan document::

    {"format": 2,
     "layout": {"dp": 1, "cp": 2, "tp": 2, "ep": 2, "pp": 1, "sequence_parallel": true,
                "loss_parallel": true, "cp_algorithm": "allgather_kv", "cp_load_balance": true},
       (the whole layout the plan was made for, as ``Layout.as_dict`` writes it: every
       size, ep included, sp, loss parallel, and the context-parallel keys where cp
       splits attention; the device mesh's axes and sizes follow from it)
     "applied_axes": ["tp"],
     "recorded_axes": {"cp": "<why not applied yet>", ...},
     "pipeline": {"stages": [[0, 24], [24, 48]]},
       (only where pp > 1: each stage's [start, end) decoder layers, the split the
       trainer runs; config/pipeline.py's ``stage_split`` made it)
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
from hyper_parallel.config.layout import Layout, LayoutError
from hyper_parallel.protocols.axes import DP, PP
from hyper_parallel.protocols.sharding import ShardingConfig
from hyper_parallel.protocols.sharding_json import (
    PlanFormatError,
    entry_role,
    full_entry,
    sharding_config_from_json,
    sharding_config_to_json,
)

PLAN_FORMAT_VERSION = 2
_DOC_KEYS = ("format", "layout", "applied_axes", "recorded_axes", "modules")


@dataclass
class PlanDocument:
    layout: Layout
    applied_axes: list[str]
    recorded_axes: dict[str, str]
    modules: dict[str, ShardingConfig]
    roles: dict[str, str] = field(default_factory=dict)
    pipeline_stages: tuple[tuple[int, int], ...] | None = None  # where pp > 1

    @property
    def context_parallel(self) -> ContextParallel | None:
        """How attention is split over cp; None where there is no cp to split over."""
        return self.layout.context_parallel if self.layout.cp > 1 else None


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


def plan_to_json(*, layout: Layout, applied_axes, recorded_axes: Mapping[str, str],
                 modules: Mapping[str, ShardingConfig], roles: Mapping[str, str] | None = None,
                 pipeline_stages=None) -> dict:
    return {
        "format": PLAN_FORMAT_VERSION,
        "layout": layout.as_dict(),
        "applied_axes": list(applied_axes),
        "recorded_axes": {str(k): str(v) for k, v in sorted(recorded_axes.items())},
        **({"pipeline": {"stages": [[int(a), int(b)] for a, b in pipeline_stages]}} if pipeline_stages else {}),
        "modules": plan_modules_to_json(modules, roles),
    }


def plan_from_json(document: Mapping, *, where: str = "plan") -> PlanDocument:
    if not isinstance(document, Mapping):
        raise PlanFormatError(f"{where}: expected an object, got {type(document).__name__}")
    if document.get("format") != PLAN_FORMAT_VERSION:
        raise PlanFormatError(f"{where}.format: expected {PLAN_FORMAT_VERSION}, got {document.get('format')!r} "
                              f"(a plan written by another version of the generator; regenerate the bundle: "
                              f"doit generate config=<the recipe>)")
    missing = [key for key in _DOC_KEYS if key not in document]
    if missing:
        raise PlanFormatError(f"{where}: missing keys {missing}")
    try:
        layout = Layout.from_dict(document["layout"], where=f"{where}.layout")
    except LayoutError as exc:
        raise PlanFormatError(str(exc)) from None
    return PlanDocument(
        layout=layout,
        applied_axes=list(document["applied_axes"]),
        recorded_axes=dict(document["recorded_axes"]),
        modules=plan_modules_from_json(document["modules"]),
        roles=plan_roles_from_json(document["modules"]),
        pipeline_stages=_pipeline_stages(document, layout, where),
    )


def _pipeline_stages(document: Mapping, layout: Layout, where: str) -> tuple[tuple[int, int], ...] | None:
    """The recorded stage split: one contiguous, non-empty [start, end) per stage from
    layer 0, present exactly where the layout has pp > 1."""
    record = document.get("pipeline")
    if record is None and layout.pp == 1:
        return None
    stages = record.get("stages") if isinstance(record, Mapping) else None
    pairs = [tuple(pair) for pair in stages] if isinstance(stages, list) and all(
        isinstance(pair, list) and len(pair) == 2 and all(type(v) is int for v in pair) for pair in stages) else None
    stages_wanted = layout.pipeline.stages(layout.pp)
    if pairs is None or len(pairs) != stages_wanted or pairs[0][0] != 0 or any(
            a >= b for a, b in pairs) or any(pairs[i][1] != pairs[i + 1][0] for i in range(len(pairs) - 1)):
        raise PlanFormatError(f"{where}.pipeline: expected {{'stages': [[start, end], ...]}} with {stages_wanted} "
                              f"contiguous non-empty layer ranges from 0 (the layout's pp {layout.pp} x virtual "
                              f"stages {layout.pipeline.virtual_stages}), got {record!r}")
    return tuple(pairs)


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
