"""The tail of the generated file: the frozen plan as a literal and
``hyper_parallelize(model, mesh_context)``, which hands it to the one applier."""

from typing import Any

from hyper_parallel.codegen.emit.literal import comment_block, render_literal
from hyper_parallel.distributed.plan_format import plan_from_json
from hyper_parallel.protocols.sharding_json import entry_line
from hyper_parallel.planning.role_legend import legend_lines


HYPER_PARALLELIZE_DEF = '''

def hyper_parallelize(model, mesh_context):
    """Shard ``model`` in place on ``mesh_context`` as HYPER_PARALLEL_PLAN says; return it."""
    return hyper_parallel_runtime.hyper_parallelize(model, mesh_context, HYPER_PARALLEL_PLAN)
'''


def check_frozen_plan(plan: Any) -> None:
    """The shape the emitter relies on: the plan document format (one validator for it)."""
    plan_from_json(plan, where="frozen_plan")


def render_parallel_section(plan: dict[str, Any]) -> str:
    """The plan with one line per module key (the codec's line form) under a legend of
    the roles it uses."""
    compact = {**plan, "modules": {key: entry_line(entry) for key, entry in plan["modules"].items()}}
    roles = list(dict.fromkeys(entry["role"] for entry in plan["modules"].values()))
    header = ["The frozen sharding plan, one line per module key (a module name or a glob): role | placements "
              "| in/out layouts.", *legend_lines(roles)]
    return (comment_block(header)
            + f"HYPER_PARALLEL_PLAN = {render_literal(compact)}\n"
            f"{HYPER_PARALLELIZE_DEF}")
