"""The tail of the generated file: the frozen plan as a literal and
``hyper_parallelize(model, mesh_context)``, which hands it to the one applier."""

from typing import Any

from hyper_parallel.codegen.emit.literal import render_literal


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
    """The shape the emitter relies on: the plan document format (one validator for it)."""
    from hyper_parallel.distributed.plan_format import plan_from_json

    plan_from_json(plan, where="frozen_plan")


def render_parallel_section(plan: dict[str, Any]) -> str:
    return ("# The frozen sharding plan: one entry per module (a glob over the model's\n"
            "# module names, e.g. model.layers.*.self_attn.q_proj) with its parameter\n"
            "# placements and the input/output layouts, per mesh axis.\n"
            f"HYPER_PARALLEL_PLAN = {render_literal(plan)}\n"
            f"{HYPER_PARALLELIZE_DEF}")
