"""The GPU tier (issue 52, item 5): the trainer on one CUDA GPU against single-process HF on
the same GPU, weights and batches.

Marked ``gpu``: skipped with the reason where CUDA is absent (tests/conftest.py), run by
``bench/gpu_check.sh`` on a lent GPU machine. Each trains the tiny Qwen3-MoE (random
weights saved with safetensors) through the trainer's CLI under ``torch.distributed.run``,
as a user does, with ``--metrics``; the reference is HF's own model trained on the same
device by hand. fp32 runs with TF32 off (the trainer does not turn it on): losses rtol
1e-5, gradient norms rtol 1e-4, as on the CPU. Mixed bf16 (float32 masters, bf16 compute)
against HF under the same autocast: rtol 2e-2 on the loss, the bf16 rounding of a
4-step run.
"""

import json
import sys

import pytest
import torch
import transformers
import yaml
from safetensors.torch import save_file

from hyper_parallel.config import load_training_config
from hyper_parallel.trainer.data import global_batch, micro_batches
from hyper_parallel.trainer.metrics import read_metrics
from tests.launch import torchrun
from tests.project_fixtures import REPO, TINY_RECIPE, make_project, run

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

STEPS = 4
FP32 = {"loss": 1e-5, "grad_norm": 1e-4}
BF16_LOSS_RTOL = 2e-2


def _project(tmp_path, *, dtype: str = "float32", nproc: int = 1, **training) -> tuple:
    """A project whose tiny recipe trains on ``nproc`` GPUs from saved random weights."""
    project = make_project(tmp_path / "project")  # tmp_path: a folder of the test's own
    recipe = project / TINY_RECIPE
    data = yaml.safe_load(recipe.read_text())
    model_dir = recipe.parent / data["model"]["pretrained_model_name_or_path"]
    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(2024)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(model_dir / "model.safetensors"))
    data["model"].pop("init", None)
    data["model"]["torch_dtype"] = dtype
    data["accelerator"].update(device_type="cuda", nproc_per_node=nproc, tp_size=nproc)
    data["training"].update(steps=STEPS, global_batch_size=4, micro_batch_size=2, **training)
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    return project, recipe


def _train(project, recipe, nproc: int = 1, *extra: str) -> list[dict]:
    metrics = project / "metrics.jsonl"
    proc = torchrun(["-m", "hyper_parallel.trainer", "--config", str(recipe), "--metrics", str(metrics), *extra],
                    cwd=project, nproc=nproc, plain=True, timeout=900, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return read_metrics(metrics)


def _reference(recipe, *, autocast: bool = False) -> tuple[list[float], list[float]]:
    """Per-step losses and gradient norms of HF's model trained by hand on the GPU."""
    config = load_training_config(recipe)
    model_dir = recipe.parent / config.model.pretrained_model_name_or_path
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                                              dtype=torch.float32).cuda()
    opt = config.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=tuple(opt.betas),
                                  weight_decay=opt.weight_decay, foreach=False)
    losses, norms = [], []
    for step in range(STEPS):
        batch = global_batch(step, config.training, config.dataset, model.config.vocab_size).cuda()
        parts = list(micro_batches(batch, 0, 1, config.training.micro_batch_size, "reference"))
        total = 0.0
        for micro in parts:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=micro, labels=micro).loss / len(parts)
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, norms


def _assert_close(rows: list[dict], losses: list[float], norms: list[float] | None, loss_rtol: float,
                  norm_rtol: float = 0.0) -> None:
    got = [(row["loss"], row["grad_norm"]) for row in rows]
    for step, ((loss, norm), want_loss) in enumerate(zip(got, losses, strict=True), start=1):
        assert abs(loss - want_loss) <= loss_rtol * abs(want_loss), (step, got, losses)
        if norms is not None:
            assert abs(norm - norms[step - 1]) <= norm_rtol * norms[step - 1], (step, got, norms)


def test_one_gpu_trains_like_hf_in_fp32(tmp_path):
    project, recipe = _project(tmp_path)
    rows = _train(project, recipe)
    losses, norms = _reference(recipe)
    _assert_close(rows, losses, norms, FP32["loss"], FP32["grad_norm"])
    assert all(peak > 0 for peak in rows[-1]["peak_memory_bytes"])  # the CUDA allocator's peak


def test_one_gpu_mixed_bf16_is_within_its_tolerance(tmp_path):
    project, recipe = _project(tmp_path, dtype="bfloat16")
    rows = _train(project, recipe)
    losses, _ = _reference(recipe, autocast=True)
    _assert_close(rows, losses, None, BF16_LOSS_RTOL)


def test_compile_and_activation_checkpointing_train_like_eager(tmp_path):
    project, recipe = _project(tmp_path, compile=True, activation_checkpointing=True)
    rows = _train(project, recipe)
    losses, norms = _reference(recipe)
    _assert_close(rows, losses, norms, 1e-4, 1e-3)  # inductor's fused kernels round otherwise


def test_a_resumed_run_continues_the_uninterrupted_one(tmp_path):
    project, recipe = _project(tmp_path / "straight")
    straight = _train(project, recipe)
    project, recipe = _project(tmp_path / "resumed", checkpoint={"dir": "ckpt", "every_steps": 2})
    data = yaml.safe_load(recipe.read_text())
    data["training"]["steps"] = 2
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    _train(project, recipe)  # two steps, saved at step 2
    data["training"]["steps"] = STEPS
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    resumed = _train(project, recipe)  # resumes from step 2
    tail = [row for row in resumed if row["step"] > 2]
    assert [row["step"] for row in tail] == [3, 4], resumed
    for row, want in zip(tail, straight[2:], strict=True):
        assert abs(row["loss"] - want["loss"]) <= 1e-6 * abs(want["loss"]), (tail, straight)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (the tp2 layout on nccl)")
def test_two_gpus_train_the_tp2_layout_like_hf(tmp_path):
    project, recipe = _project(tmp_path, nproc=2)
    rows = _train(project, recipe, 2)
    losses, norms = _reference(recipe)
    _assert_close(rows, losses, norms, FP32["loss"], FP32["grad_norm"])


def test_dry_run_of_every_rank_of_a_tp2_layout_runs_on_one_gpu(tmp_path):
    project, recipe = _project(tmp_path, nproc=2)
    proc = run([sys.executable, "-m", "hyper_parallel.trainer", "dry-run", "--config", str(recipe), "--rank", "all",
                "--steps", "2", "--json", str(tmp_path / "dry.json")], project, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    reports = json.loads((tmp_path / "dry.json").read_text())
    assert [r["rank"] for r in reports] == [0, 1], reports
    assert all(r["device"] == "cuda:0" and r["peak_memory_bytes"] > 0 for r in reports), reports
