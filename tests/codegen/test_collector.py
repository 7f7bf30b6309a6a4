"""The cycle collector around codegen's work: paused while derive makes its many small
objects, frozen after each stage of the build tool's own short-lived process."""

import gc
import subprocess
import sys

import pytest

from hyper_parallel.codegen.plan.derive import collector_paused
from tests.project_fixtures import TINY_RECIPE, make_project


@pytest.mark.parametrize("enabled", [True, False])
def test_collector_paused_restores_the_collector_as_it_was(enabled):
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
        with pytest.raises(KeyError), collector_paused():
            raise KeyError("a failed derive")
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()


FROZEN_AFTER_A_STAGE = """
import gc, runpy
from doit.cmd_base import ModuleTaskLoader
from doit.doit_cmd import DoitMain
assert gc.get_freeze_count() == 0
assert DoitMain(ModuleTaskLoader(runpy.run_path("dodo.py"))).run(["resolve", "config={recipe}"]) == 0
print("frozen", gc.get_freeze_count())
"""


def test_the_build_tool_freezes_what_a_stage_left(tmp_path):
    """doit's stage action freezes the heap after a stage (no later collection, nor the
    last one at exit, walks torch's and transformers' objects again)."""
    project = make_project(tmp_path)
    proc = subprocess.run([sys.executable, "-c", FROZEN_AFTER_A_STAGE.format(recipe=TINY_RECIPE)], cwd=project,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    frozen = int(proc.stdout.split("frozen")[-1])
    assert frozen > 1000, proc.stdout


def test_a_later_stage_s_garbage_cycles_are_collected_before_freezing():
    """Once the heap is frozen, keep_until_exit collects what is not frozen before
    freezing it: a cycle a later stage dropped is freed, not kept to the end."""
    code = """
import gc, weakref
from hyper_parallel.codegen.stages import keep_until_exit
keep_until_exit()
class Node: pass
node = Node(); node.self = node; alive = weakref.ref(node); del node
keep_until_exit()
print("freed", alive() is None)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["freed", "True"], proc.stdout
