"""A parameter packing blocks of unequal widths stored sharded over tp, in packed order
(``local_views.PackedRows``: Qwen3-Next's depthwise convolution over ``[q | k | v]``
channels, ``key_dim``, ``key_dim`` and ``value_dim`` wide), through the checkpoint: saved
as its blocks in the model's order, so a checkpoint does not depend on the tp size.

A tiny Qwen3-Next trains 4 steps at tp2 (its generated bundle) and saves step 2 as
blocks; one process (hf backend) resumes step 2 and trains to step 6, saving step 4
whole; dp2 with FSDP2 resumes tp2's step 2 (the blocks into rows split over dp); tp2
resumes the one process's whole step 4 (into packed order). Every resumed step equals
the uninterrupted run's, and tp2's checkpoint exports to the same HF tensors as one
process's at the same step. tp2's first run and dp2's resume train in one launch
(tests/trainer/train_chain_worker.py)."""

import json
import math
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from hyper_parallel.codegen.check.verify_mode import MAX_PROCS_ENV
from hyper_parallel.testing.family_case import Case, make_project, run_case
from hyper_parallel.testing.tiny_families import family_dir, save_checkpoint
from hyper_parallel.trainer.checkpoint_layout import saved_tensors
from hyper_parallel.trainer.export import export_checkpoint
from hyper_parallel.trainer.metrics import read_metrics
from tests.launch import assert_ran, torchrun
from tests.project_fixtures import REPO

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FAMILY = "qwen3_next"
CONV = "model.layers.0.linear_attn.conv1d.weight"


@pytest.fixture(scope="module")
def project(tmp_path_factory, monkeypatch_module):
    """A project with the tiny Qwen3-Next checkpoint and its tp2 bundle generated."""
    monkeypatch_module.setenv(MAX_PROCS_ENV, "1")
    root = make_project(tmp_path_factory.mktemp("packed") / "project")
    save_checkpoint(FAMILY, root / "recipes" / family_dir(FAMILY) / "model")
    case = run_case(root, Case(FAMILY, "tp2"), timeout=300, train=False)
    assert case.status == "pass", case.reason
    return root


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _recipe(project, name: str, *, tp: int, dp: int, steps: int, checkpoints: str):
    """The tp2 recipe at another layout and length, checkpointing every 2 steps; ``tp2``
    keeps the recipe's own path (its bundle is current: checkpoints are no codegen input),
    the others are hf-backend copies beside it."""
    folder = project / "recipes" / family_dir(FAMILY) / "tp2"
    data = yaml.safe_load((folder / "recipe.yaml").read_text())
    data["accelerator"].update(tp_size=tp, dp_size=dp, nproc_per_node=tp * dp)
    data["training"].update(steps=steps, checkpoint={"dir": checkpoints, "every_steps": 2, "keep_last": 0,
                                                     "async": False})
    if name != "tp2":
        data.pop("codegen", None)
        data["modeling_backend"] = "hf"
    path = folder / ("recipe.yaml" if name == "tp2" else f"{name}.yaml")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _train(project, tmp_path, name: str, run_name: str | None = None, **layout) -> list[dict]:
    recipe = _recipe(project, name, **layout)
    metrics = tmp_path / f"{run_name or name}.json"
    proc = torchrun(["-m", "hyper_parallel.trainer", "--config", str(recipe), "--metrics", str(metrics)],
                    project, nproc=layout["tp"] * layout["dp"])
    assert_ran(proc)
    return read_metrics(metrics)


def _train_chain(project, tmp_path, runs) -> list[list[dict]]:
    """``runs`` (name, layout, [(source, destination) checkpoint copies]) of world 2 trained
    in turn by one launch (tests/trainer/train_chain_worker.py: a new trainer per run, each
    as the trainer CLI trains it); each run's per-step metrics."""
    chain = []
    for name, layout, copies in runs:
        assert layout["tp"] * layout["dp"] == 2, layout
        recipe = _recipe(project, name, **layout)
        chain.append({"name": name, "recipe": str(recipe), "text": recipe.read_text(), "copies": [
            [str(a), str(b)] for a, b in copies], "metrics": str(tmp_path / f"{name}.json")})
    (tmp_path / "chain.json").write_text(json.dumps(chain))
    proc = torchrun(["-m", "tests.trainer.train_chain_worker", "--chain", str(tmp_path / "chain.json")], project,
                    nproc=2, env={"PYTHONPATH": str(REPO)})
    assert_ran(proc)
    return [read_metrics(run["metrics"]) for run in chain]


def _same_steps(got: list[dict], want: list[dict], where: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want], where
    for a, b in zip(got, want):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (where, got, want)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (where, got, want)


def _exported(step, out) -> dict[str, torch.Tensor]:
    """A checkpoint exported by one process (``export_checkpoint``, what ``trainer export``
    runs; its command line is launched in tests/trainer/test_checkpoint_reshard.py): the HF
    tensors it wrote. In this process: a subprocess would import torch and transformers again."""
    export_checkpoint(step, out)
    tensors = {}
    for file in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def test_a_packed_parameter_is_checkpointed_as_its_blocks_and_resumes_at_any_layout(project, tmp_path):
    folder = project / "recipes" / family_dir(FAMILY) / "tp2"
    # the world-2 legs from tp2's step 2 in one launch: tp2 saves it, dp2 resumes it
    uninterrupted, dp2 = _train_chain(project, tmp_path, [
        ("tp2", dict(tp=2, dp=1, steps=4, checkpoints="ck_tp2"), []),
        ("dp2", dict(tp=1, dp=2, steps=4, checkpoints="ck_dp2"),
         [(folder / "ck_tp2" / "step_2", folder / "ck_dp2" / "step_2")])])
    saved = saved_tensors(folder / "ck_tp2" / "step_2")
    key = f"model.{CONV}"
    assert key not in saved
    blocks = [saved[f"{key}@part{k}of3"] for k in range(3)]
    assert blocks[0][0] == blocks[1][0] < blocks[2][0], blocks  # key_dim, key_dim, value_dim: the model's blocks
    assert [saved[f"optim.state.{CONV}.exp_avg@part{k}of3"] for k in range(3)] == blocks

    shutil.copytree(folder / "ck_tp2" / "step_2", folder / "ck_one" / "step_2")
    one = _train(project, tmp_path, "one", tp=1, dp=1, steps=6, checkpoints="ck_one")
    _same_steps(one[:2], uninterrupted[2:], "tp2 (blocks) -> one process (whole)")
    assert key in saved_tensors(folder / "ck_one" / "step_4")

    _same_steps(dp2, uninterrupted[2:], "tp2 (blocks) -> dp2 with FSDP2 (rows split over dp)")

    shutil.copytree(folder / "ck_one" / "step_4", folder / "ck_back" / "step_4")
    back = _train(project, tmp_path, "tp2", "back", tp=2, dp=1, steps=6, checkpoints="ck_back")
    _same_steps(back, one[2:], "one process (whole) -> tp2 (packed order)")

    packed = _exported(folder / "ck_tp2" / "step_4", tmp_path / "hf_tp2")
    whole = _exported(folder / "ck_one" / "step_4", tmp_path / "hf_one")
    assert packed.keys() == whole.keys()
    for name, tensor in whole.items():
        torch.testing.assert_close(packed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
