"""The parallel axes are spelled in one module (``hyper_parallel/protocols/axes.py``):
nowhere else in the package is a sequence of axis names written out, so an axis or an
order changes in one place (issue 29)."""

import re
from pathlib import Path

import hyper_parallel
from hyper_parallel.config.parallel_dims import SIZES
from hyper_parallel.distributed.mesh import EXPERT_MESH_AXIS_ORDER, MESH_AXIS_ORDER
from hyper_parallel.protocols import axes

PACKAGE = Path(hyper_parallel.__file__).parent
NAME = r"""["'](?:pp|dp|cp|tp|ep|edp|sp)["']"""
# Two axis names in a row, in a tuple, list, set, call or subscript: a spelled-out sequence.
SEQUENCE = re.compile(rf"{NAME}\s*,\s*{NAME}")
# A module-level constant holding one axis name (``CP_AXIS = "cp"``): a second spelling.
CONSTANT = re.compile(rf"^[A-Z_]+\s*=\s*{NAME}\s*$", re.MULTILINE)


def test_no_module_but_axes_spells_out_axis_names():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(axes.__file__):
            continue
        text = path.read_text()
        for pattern in (SEQUENCE, CONSTANT):
            for match in pattern.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{path.relative_to(PACKAGE)}:{line}: {match.group(0)}")
    assert not found, "axis names spelled outside protocols/axes.py:\n" + "\n".join(found)


def test_the_orders_everyone_reads_are_the_axes_module_s():
    assert SIZES is axes.SIZE_AXES
    assert MESH_AXIS_ORDER is axes.MESH_AXES and EXPERT_MESH_AXIS_ORDER is axes.EXPERT_MESH_AXES
    assert set(axes.SIZE_AXES) == {axis.value for axis in axes.MeshAxisName}


def test_the_grep_finds_a_spelled_out_tuple():
    """The check above can fail: the patterns match the forms they are named after."""
    assert SEQUENCE.search('MESH_AXES = ("pp", "dp", "cp", "tp")')
    assert SEQUENCE.search("for axes in (('tp',), ('cp', 'tp')):")
    assert CONSTANT.search('CP_AXIS = "cp"\n')
    assert not SEQUENCE.search('get_group("dp")')
