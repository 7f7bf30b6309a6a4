"""Checkpoints under torchrun (gloo, CPU): a run saves every 2 steps and keeps the last
2; its last checkpoint is then made partial (marker gone, as a kill between the ranks'
writes and the rename would leave it) and a killed save's ``.tmp-`` folder is planted;
the restarted run removes both, resumes from step 4 and trains steps 5 and 6 to exactly
the losses and gradient norms of the uninterrupted run.

Each layout's runs (uninterrupted with checkpoints, resumed, and at tp2 ``--no-resume``)
train in turn in one launch per world size (tests/trainer/train_cases_worker.py), plus one
CLI launch at pp2 that refuses an old checkpoint format: the tiny model trains in seconds."""

import json
import math

import pytest
import yaml

from hyper_parallel.trainer.metrics import read_metrics
from tests.batch_launch import Batches
from tests.launch import torchrun
from tests.pipeline.pipeline_helpers import copy_project, generated_tiny_project
from tests.project_fixtures import REPO, TINY_RECIPE, make_project

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


def _launch(world: int, out, cases):
    return torchrun(["-m", "tests.trainer.train_cases_worker", "--out", str(out), "--cases", str(cases)], out,
                    nproc=world, env={"PYTHONPATH": str(REPO)}, preload=(QWEN3_MOE_MODELING,), timeout=900)


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """Each layout's own project and recipe; its runs (uninterrupted, resumed, and at tp2
    ``--no-resume``) trained by one launch per world size, each layout's in turn
    (tests/trainer/train_cases_worker.py: a new trainer per run; between the uninterrupted
    and the resumed run rank 0 makes step 6 partial and plants a killed save, as the test
    did between two launches). Per layout: its project, recipe, content, folder of files."""
    root = tmp_path_factory.mktemp("checkpoint_resume")
    cases, layouts = {}, {}
    for layout in sorted(LAYOUTS):
        folder = root / layout
        if layout == "tp2":  # the tiny recipe's own layout: the suite's generated copy (training is no codegen input)
            project = copy_project(generated_tiny_project(tmp_path_factory), folder / "project")
        else:
            project = make_project(folder / "project")
        recipe = project / TINY_RECIPE
        data = yaml.safe_load(recipe.read_text())
        data["accelerator"].update(LAYOUTS[layout]["accelerator"])
        data.update(LAYOUTS[layout].get("recipe", {}))
        data["training"].update(steps=6, global_batch_size=4, micro_batch_size=2, seq_len=12, checkpoint={
            "dir": "checkpoints", "every_steps": 2, "keep_last": 2, "async": LAYOUTS[layout]["async"]})
        recipe.write_text(yaml.safe_dump(data, sort_keys=False))
        ckpt = recipe.parent / "checkpoints"
        layouts[layout] = project, recipe, data, folder
        world = LAYOUTS[layout]["accelerator"]["nproc_per_node"]

        def run(name: str, *flags: str) -> tuple[int, list[str]]:
            return world, ["--recipe", str(recipe), "--metrics", str(folder / f"{name}.json"),
                           "--log", str(folder / f"{name}.log"), "--workspace", str(project / "generated"), *flags]

        cases[f"{layout}_1_whole"] = run("whole")
        cases[f"{layout}_2_resumed"] = run(
            "resumed", "--list", str(ckpt), "--unlink", str(ckpt / "step_6" / "COMPLETE.json"),  # never marked
            "--plant", str(ckpt / "step_5.tmp-0123abcd" / "__0_0.distcp"))  # a save killed midway
        if layout == "tp2":  # --no-resume starts from the model's weights, checkpoints or not
            fresh = folder / "fresh.yaml"
            fresh.write_text(yaml.safe_dump({**data, "training": {**data["training"], "steps": 2}}, sort_keys=False))
            cases[f"{layout}_3_fresh"] = run("fresh", "--no-resume", "--text", str(fresh), "--list", str(ckpt))
    return Batches(root / "out", cases, _launch), layouts


def _log(folder, name: str, world: int) -> str:
    """What the run's ranks logged (the trainer CLI's stdout)."""
    return "".join((folder / f"{name}.log.rank{rank}").read_text() for rank in range(world))


def _assert_same_steps(got, want):
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-7), (got, want)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-7), (got, want)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_resumed_run_continues_exactly(batches, layout):
    batched, layouts = batches
    project, recipe, data, folder = layouts[layout]
    world = LAYOUTS[layout]["accelerator"]["nproc_per_node"]
    root = recipe.parent / "checkpoints"

    batched.results(f"{layout}_1_whole")
    whole = read_metrics(folder / "whole.json")
    assert [r["step"] for r in whole] == [1, 2, 3, 4, 5, 6]
    before = batched.results(f"{layout}_2_resumed")[0]["before"]  # as the uninterrupted run left the folder
    assert sorted(before) == ["step_4", "step_6"]  # keep_last 2 removed step_2
    marker = before["step_4"]
    assert marker["step"] == 4 and marker["data"]["next_step"] == 4
    assert marker["world_size"] == LAYOUTS[layout]["accelerator"]["nproc_per_node"]

    # the resumed run: step 6 made partial and a killed save planted before it
    resumed, out = read_metrics(folder / "resumed.json"), _log(folder, "resumed", world)
    assert f"resumed from checkpoint {root / 'step_4'} (step 4)" in out
    assert f"removed partial checkpoint {root / 'step_6'}" in out
    assert f"removed partial checkpoint {root / 'step_5.tmp-0123abcd'}" in out
    assert "step 4/6" not in out and "step 5/6" in out
    _assert_same_steps(resumed, whole[4:])  # the metrics list only the steps this run ran
    after = batched.results(f"{layout}_3_fresh")[0]["before"] if layout == "tp2" else {
        p.name: None for p in root.iterdir()}  # tp2: as the resumed run left it, before --no-resume
    assert sorted(after) == ["step_4", "step_6"]
    assert (root / "step_6" / "COMPLETE.json").is_file()
    if layout == "tp2":
        assert after["step_6"] is not None
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
        fresh, out = read_metrics(folder / "fresh.json"), _log(folder, "fresh", world)
        assert "resumed from" not in out
        _assert_same_steps(fresh, whole[:2])
        # step_2 saved again; keep_last 2 keeps the newest steps, 4 and 6
        assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_6"]
