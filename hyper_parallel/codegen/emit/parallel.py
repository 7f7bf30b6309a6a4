"""The tail of the generated file: the frozen plan as a literal and
``hyper_parallelize(model, mesh_context)``, which hands it to the one applier."""

from typing import Any

from hyper_parallel.codegen.emit.literal import render_literal

PLAN_FORMAT = 1
_PLAN_KEYS = ("format", "mesh", "applied_axes", "recorded_axes", "modules")

HYPER_PARALLELIZE_DEF = '''

def hyper_parallelize(model, mesh_context):
    """Shard ``model`` in place on ``mesh_context`` as HYPER_PARALLEL_PLAN says; return it.

    Applies the axes in ``HYPER_PARALLEL_PLAN["applied_axes"]``; the others are only
    recorded. The trainer still builds the mesh and owns data parallel (FSDP2),
    pipeline splitting, activation checkpointing and torch.compile.
    """
    return hyper_parallel_runtime.hyper_parallelize(model, mesh_context, HYPER_PARALLEL_PLAN)
'''


def check_frozen_plan(plan: Any) -> None:
    """The shape the emitter relies on (the freeze stage validates the details)."""
    if not isinstance(plan, dict):
        raise ValueError(f"frozen_plan: expected a mapping, got {type(plan).__name__}")
    missing = [key for key in _PLAN_KEYS if key not in plan]
    if missing:
        raise ValueError(f"frozen_plan: missing keys {missing}; expected {list(_PLAN_KEYS)}")
    if plan["format"] != PLAN_FORMAT:
        raise ValueError(f"frozen_plan.format: expected {PLAN_FORMAT}, got {plan['format']!r}")
    mesh = plan["mesh"]
    if not isinstance(mesh, dict) or len(mesh.get("axes", ())) != len(mesh.get("sizes", ())):
        raise ValueError(f"frozen_plan.mesh: expected {{'axes': [...], 'sizes': [...]}} of equal length, got {mesh!r}")
    if not isinstance(plan["modules"], dict):
        raise ValueError(f"frozen_plan.modules: expected a mapping of module pattern to entry, "
                         f"got {type(plan['modules']).__name__}")


def render_parallel_section(plan: dict[str, Any]) -> str:
    return ("# The frozen sharding plan: one entry per module (a glob over the model's\n"
            "# module names, e.g. model.layers.*.self_attn.q_proj) with its parameter\n"
            "# placements and the input/output layouts, per mesh axis.\n"
            f"HYPER_PARALLEL_PLAN = {render_literal(plan)}\n"
            f"{HYPER_PARALLELIZE_DEF}")
