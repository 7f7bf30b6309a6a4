"""Issue 51: a head-split hybrid at tp2 through ``doit generate``, preflight included.

A head-split entry places a child's parameter by its dotted name (Qwen3-Next's
``model.layers.*.linear_attn`` entry places ``conv1d.weight``, the packed [q | k | v]
convolution its own code runs). The applier always read it so; preflight's coverage
check split each parameter name at its last dot and looked for an entry of
``...linear_attn.conv1d``, so before the fix generate installed the bundle and failed:

    PreflightError: .../modeling_Qwen3_Next_gen_cpu.py: the frozen plan covers no entry
    for parameter(s) model.layers.0.linear_attn.conv1d.weight, ...

Every reader now asks ``name_match.placed_parameters``."""

import pytest

from hyper_parallel.distributed.name_match import placement_of
from hyper_parallel.distributed.plan_format import plan_entries
from hyper_parallel.runtime.loader import load_generated_module
from hyper_parallel.testing.family_case import make_project, write_recipe
from hyper_parallel.testing.tiny_families import family_dir, save_checkpoint
from tests.project_fixtures import doit

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FAMILY = "qwen3_next"
CHILD_PARAMETER = "model.layers.0.linear_attn.conv1d.weight"


def test_doit_generate_preflights_a_plan_entry_naming_a_childs_parameter(tmp_path):
    project = make_project(tmp_path / "project")
    save_checkpoint(FAMILY, project / "recipes" / family_dir(FAMILY) / "model")
    recipe = write_recipe(project, FAMILY, "tp2")
    proc = doit(project, "generate", f"config={recipe.relative_to(project)}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[preflight] ok on 2 ranks" in out, out[-4000:]

    plan = plan_entries(load_generated_module(recipe.parent / "generated").HYPER_PARALLEL_PLAN)
    placed = placement_of(CHILD_PARAMETER, plan)
    assert placed is not None and placed.state == "conv1d.weight", placed  # the case this test is for
    assert placed.key.endswith(".linear_attn") and placed.placement == {"tp": "shard(0)"}, placed
