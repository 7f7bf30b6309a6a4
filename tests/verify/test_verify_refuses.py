"""verify refuses broken plans before install, naming the parameter or module and the plan
entry, and leaves the installed bundle byte-identical (issue: verify before install)."""

import shutil

import pytest
import yaml

from tests.pipeline.pipeline_helpers import doit_generated_tiny_project
from tests.project_fixtures import REPO, TINY_RECIPE, bundle_bytes, doit, tasks_ran

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

BUNDLE = "recipes/tiny_cpu/generated"
CP2 = {"tp_size": 1, "cp_size": 2}
# The cases that break the gathered attention name that algorithm (the default splits attention).
CP2_GATHERED = {**CP2, "context_parallel": {"algorithm": "gather_sequence"}}

BROKEN = {
    # colwise_gather_output read as an output head: q is gathered, o_proj expects it split.
    "q_proj_gathers_its_output": (
        {}, {"match": "model.layers.*.self_attn.q_proj", "out_dst": [{"tp": "replicate"}]},
        ["in model.layers.0.self_attn", "ran inside model.layers.0.self_attn first: model.layers.0.self_attn.q_proj",
         "plan entry 'model.layers.*.self_attn.q_proj'"]),
    # Attention's input no longer gathered over cp: each rank attends over half a sequence.
    "attention_gather_removed": (
        CP2_GATHERED, {"match": "model.layers.*.self_attn", "in_dst": [{"cp": "shard(1)"}],
              "out_src": [{"cp": "shard(1)"}, None]},
        ["model.layers.*.self_attn"]),
    # o_proj's input declared split over cp after attention gathered it: the loss is the
    # same, the weight's gradient is summed over both cp ranks (2x).
    "o_proj_gradient_counted_twice_over_cp": (
        CP2_GATHERED, {"match": "model.layers.*.self_attn.o_proj", "in_src": [{"cp": "shard(1)"}],
              "in_dst": [{"cp": "shard(1)"}]},
        ["gradient of model.layers.0.self_attn.o_proj.weight", "plan entry 'model.layers.*.self_attn.o_proj'",
         "error is in backward"]),
    # (Tied embeddings under cp, once found by verify — the cp ranks' copies of the tied
    # weight differed — now train equal to one process: tests/families/test_fix_tied_embeddings.py.)
    "replacement_of_the_wrong_shape": (
        {}, {"match": "*.self_attn.o_proj",
             "replace_module": {"_target_": "tests.verify.broken_replacements.wider_o_proj"}},
        ["model.layers.0.self_attn.o_proj.weight", "size mismatch"]),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_verify_refuses_a_broken_plan_and_keeps_the_old_bundle(tmp_path_factory, tmp_path, case):
    # A project ``doit generate`` built through the preflight (once per run, shared with
    # tests/pipeline/test_incremental.py).
    installed, _ = doit_generated_tiny_project(tmp_path_factory)
    project = tmp_path / "project"
    shutil.copytree(installed, project, symlinks=True)
    before = bundle_bytes(project / BUNDLE)
    accelerator, override, expected = BROKEN[case]
    recipe = project / TINY_RECIPE
    data = yaml.safe_load(recipe.read_text())
    data["accelerator"].update(accelerator)
    data["plan_overrides"] = [override]
    data["model"]["trusted_modules"] = ["tests.verify"]  # broken_replacements
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))

    # The replacement factory lives in this test package.
    proc = doit(project, "generate", f"config={TINY_RECIPE}", env={"PYTHONPATH": str(REPO)})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "verify" in tasks_ran(out) and "install" not in tasks_ran(out), out
    assert "verify" in out and "failed" in out, out
    for text in expected:
        assert text in out, (text, out[-4000:])
    assert bundle_bytes(project / BUNDLE) == before
