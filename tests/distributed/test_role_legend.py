"""Every role the planner can write has a line in the legend the generated file prints."""

import re
from pathlib import Path

from hyper_parallel.planning import roles
from hyper_parallel.planning.role_legend import ROLE_LEGEND, legend_lines

DISTRIBUTED = Path(roles.__file__).parent
# How the planner names a role in its source: roles[...] = "x", role="x", role: str = "x".
ROLE_WRITES = re.compile(r'roles\[[^\]]+\] = "(\w+)"|role="(\w+)"|role: str = "(\w+)"')


def test_every_role_builder_and_every_role_written_has_a_legend_line():
    written = {name for path in DISTRIBUTED.glob("*.py")
               for match in ROLE_WRITES.finditer(path.read_text()) for name in match.groups() if name}
    assert {"sequence_split", "attention_block", "moe_block"} <= written  # the scan sees the sequence roles
    assert set(roles.ROLE_BUILDERS) | written <= set(ROLE_LEGEND)


def test_the_legend_lists_the_plan_roles_in_order_and_keeps_an_unknown_one():
    lines = legend_lines(["rowwise", "colwise", "brand_new"])
    assert [line.split()[0] for line in lines[1:4]] == ["rowwise", "colwise", "brand_new"]
    assert "(no legend entry)" in lines[3]
