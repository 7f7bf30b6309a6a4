"""The tail of the generated file: the frozen plan as a literal and
``hyper_parallelize(model, mesh_context)``, which hands it to the one applier."""

import textwrap
from typing import Any

from hyper_parallel.codegen.emit.literal import render_literal
from hyper_parallel.distributed.plan_format import plan_from_json
from hyper_parallel.protocols.sharding_json import compact_entry
from hyper_parallel.distributed.role_legend import legend_lines


PLAN_WIDTH = 119  # transformers' own line length, which the rest of the file follows

HYPER_PARALLELIZE_DEF = '''

def hyper_parallelize(model, mesh_context):
    """Shard ``model`` in place on ``mesh_context`` as HYPER_PARALLEL_PLAN says; return it."""
    return hyper_parallel_runtime.hyper_parallelize(model, mesh_context, HYPER_PARALLEL_PLAN)
'''


def check_frozen_plan(plan: Any) -> None:
    """The shape the emitter relies on: the plan document format (one validator for it)."""
    plan_from_json(plan, where="frozen_plan")


def render_parallel_section(plan: dict[str, Any]) -> str:
    """The plan in the codec's compact form under a legend of the roles it uses."""
    compact = {**plan, "modules": {key: compact_entry(entry) for key, entry in plan["modules"].items()}}
    roles = list(dict.fromkeys(entry["role"] for entry in plan["modules"].values()))
    header = ["The frozen sharding plan: per module key (a module name, or a glob over module names), the",
              "parameters' placements and the input/output layouts, per mesh axis.", *legend_lines(roles)]
    wrapped = [part for line in header
               for part in textwrap.wrap(line, width=98, subsequent_indent="  ", break_long_words=False)]
    return ("".join(f"# {line}\n" for line in wrapped)
            + f"HYPER_PARALLEL_PLAN = {render_literal(compact, width=PLAN_WIDTH)}\n"
            f"{HYPER_PARALLELIZE_DEF}")
