from hyper_parallel.trainer.metrics import read_metrics
"""Checkpoints under torchrun (gloo, CPU): a run saves every 2 steps and keeps the last
2; its last checkpoint is then made partial (marker gone, as a kill between the ranks'
writes and the rename would leave it) and a killed save's ``.tmp-`` folder is planted;
the restarted run removes both, resumes from step 4 and trains steps 5 and 6 to exactly
the losses and gradient norms of the uninterrupted run.

Two launches per layout (one uninterrupted run with checkpoints, one resumed run), plus
one ``--no-resume`` launch at tp2: the tiny model trains in seconds."""

import json
import math

import pytest
import yaml

from tests.launch import assert_ran, torchrun
from tests.pipeline.pipeline_helpers import copy_project, generated_tiny_project
from tests.project_fixtures import TINY_RECIPE, make_project

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

QWEN3_MOE_MODELING = "transformers.models.qwen3_moe.modeling_qwen3_moe"  # imported once, before the ranks fork

LAYOUTS = {
    # tp2 shards the fused gate_up_proj as _StridedShard: saved as one block per part.
    "tp2": {"accelerator": {"nproc_per_node": 2, "tp_size": 2}, "async": False},
    # FSDP2 over dp2, saved in the background (dcp.async_save).
    "dp2_fsdp2_async": {"accelerator": {"nproc_per_node": 2, "dp_size": 2, "tp_size": 1}, "async": True},
    # The custom backend (models/common names, fused experts): its checkpoints carry the
    # HF config and weight map for export, and resume like the others.
    "custom_tp2": {"accelerator": {"nproc_per_node": 2, "tp_size": 2}, "async": False,
                   "recipe": {"codegen": False, "modeling_backend": "custom"}},
    # FSDP2 over tp: dp shards the tp-sharded embedding again (_StridedShard over Shard on
    # one dimension: each rank's rows one contiguous range, saved as DCP saves it).
    "tp2_dp2_fsdp2": {"accelerator": {"nproc_per_node": 4, "dp_size": 2, "tp_size": 2}, "async": False,
                      "recipe": {"codegen": False, "modeling_backend": "hf"}},
    # Pipeline stages: each rank saves and loads its own stage's part of the model.
    "pp2": {"accelerator": {"nproc_per_node": 2, "pp_size": 2, "tp_size": 1}, "async": False},
}


def _train(project, recipe, metrics, *args):
    nproc = yaml.safe_load(recipe.read_text())["accelerator"]["nproc_per_node"]
    proc = torchrun(["-m", "hyper_parallel.trainer", "--config", str(recipe), "--metrics", str(metrics), *args],
                    project, nproc=nproc, preload=(QWEN3_MOE_MODELING,))
    assert_ran(proc)
    return proc, read_metrics(metrics)


def _assert_same_steps(got, want):
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-7), (got, want)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-7), (got, want)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_resumed_run_continues_exactly(tmp_path_factory, tmp_path, layout):
    if layout == "tp2":  # the tiny recipe's own layout: the suite's generated copy (training is no codegen input)
        project = copy_project(generated_tiny_project(tmp_path_factory), tmp_path / "project")
    else:
        project = make_project(tmp_path / "project")
    recipe = project / TINY_RECIPE
    data = yaml.safe_load(recipe.read_text())
    data["accelerator"].update(LAYOUTS[layout]["accelerator"])
    data.update(LAYOUTS[layout].get("recipe", {}))
    data["training"].update(steps=6, global_batch_size=4, micro_batch_size=2, seq_len=12, checkpoint={
        "dir": "checkpoints", "every_steps": 2, "keep_last": 2, "async": LAYOUTS[layout]["async"]})
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    root = recipe.parent / "checkpoints"

    proc, whole = _train(project, recipe, tmp_path / "whole.json")
    assert [r["step"] for r in whole] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_6"]  # keep_last 2 removed step_2
    marker = json.loads((root / "step_4" / "COMPLETE.json").read_text())
    assert marker["step"] == 4 and marker["data"]["next_step"] == 4
    assert marker["world_size"] == LAYOUTS[layout]["accelerator"]["nproc_per_node"]

    (root / "step_6" / "COMPLETE.json").unlink()  # saved but never marked complete
    (root / "step_5.tmp-0123abcd").mkdir()  # a save killed midway
    (root / "step_5.tmp-0123abcd" / "__0_0.distcp").write_bytes(b"partial")
    proc, resumed = _train(project, recipe, tmp_path / "resumed.json")
    assert f"resumed from checkpoint {root / 'step_4'} (step 4)" in proc.stdout
    assert f"removed partial checkpoint {root / 'step_6'}" in proc.stdout
    assert f"removed partial checkpoint {root / 'step_5.tmp-0123abcd'}" in proc.stdout
    assert "step 4/6" not in proc.stdout and "step 5/6" in proc.stdout
    _assert_same_steps(resumed, whole[4:])  # the metrics list only the steps this run ran
    assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_6"]
    assert (root / "step_6" / "COMPLETE.json").is_file()
    if layout == "custom_tp2":  # what `trainer export` needs to write HF files from it
        recorded = json.loads((root / "step_6" / "hf" / "weight_map.json").read_text())
        assert recorded["model.layers.*.self_attn.q_proj.weight"] == "layers.*.attention.q_proj.weight"

    if layout == "pp2":  # a checkpoint of the earlier format (another optimizer state form) is refused, named
        marker_file = root / "step_6" / "COMPLETE.json"
        marker_file.write_text(json.dumps({**json.loads(marker_file.read_text()), "format": 1}))
        data["training"]["steps"] = 8
        recipe.write_text(yaml.safe_dump(data, sort_keys=False))
        proc = torchrun(["-m", "hyper_parallel.trainer", "--config", str(recipe)], project, nproc=2,
                        preload=(QWEN3_MOE_MODELING,))
        assert proc.returncode != 0
        assert f"checkpoint {root / 'step_6'} has format 1, this version reads 2" in proc.stdout + proc.stderr
        assert "--no-resume" in proc.stdout + proc.stderr

    if layout == "tp2":  # --no-resume starts from the model's weights, checkpoints or not
        data["training"]["steps"] = 2
        recipe.write_text(yaml.safe_dump(data, sort_keys=False))
        proc, fresh = _train(project, recipe, tmp_path / "fresh.json", "--no-resume")
        assert "resumed from" not in proc.stdout
        _assert_same_steps(fresh, whole[:2])
        # step_2 saved again; keep_last 2 keeps the newest steps, 4 and 6
        assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_6"]
