"""The custom backend (``models/common``, issue 28) trained by ``python -m
hyper_parallel.trainer`` equals single-process HF training on the same weights (fp32):
per-step losses and gradient norms within the suite's 1e-4 at tp2 with sequence and loss
parallel (the vocab-sharded cross entropy), cp2 with allgather_kv, dp2 with FSDP2 and
dp2+ep2 (the routed experts split over ep, sharded by FSDP2 over edp). One world-2
launch trains the four layouts in turn (tests/trainer/train_chain_worker.py). The head's
loss equals HF's exactly in one process, ignore_index labels included."""

import json
import math

import pytest
import torch
import transformers
import yaml

from hyper_parallel.models.hf.model_builder import load_hf_tensors
from hyper_parallel.models.qwen3_moe.custom_model import build_custom_model
from hyper_parallel.trainer.metrics import read_metrics
from hyper_parallel.trainer.reference import reference_training
from tests.launch import assert_ran, torchrun
from tests.project_fixtures import REPO, TINY_RECIPE, make_project

QWEN3_MOE_MODELING = "transformers.models.qwen3_moe.modeling_qwen3_moe"
STEPS = 4
LAYOUTS = {
    "tp2_sp_lp": {"tp_size": 2, "sequence_parallel": True, "loss_parallel": True},
    "cp2_allgather_kv": {"tp_size": 1, "cp_size": 2, "context_parallel": {"algorithm": "allgather_kv"}},
    "dp2_fsdp2": {"tp_size": 1, "dp_size": 2},
    "dp2_ep2_fsdp2": {"tp_size": 1, "dp_size": 2, "ep_size": 2},
}


def _hf_model(model_dir, seed: int = 7):
    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)


def test_the_custom_head_computes_hf_causal_lm_loss():
    model_dir = REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"
    hf = _hf_model(model_dir)
    custom = build_custom_model(hf.config)
    load_hf_tensors(custom, hf.config, hf.state_dict())
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100  # ignored positions, as a padded batch has
    want, got = hf(input_ids=ids, labels=labels), custom(input_ids=ids, labels=labels)
    # fp32 to a few ulps, not bit for bit: the two models' expert matmuls have other shapes,
    # and a CPU's BLAS may block those differently (1.2e-7 apart on an AMD EPYC)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(custom(ids), want.logits, rtol=1e-6, atol=1e-6)  # the library call: tokens in, logits out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("custom_training")
    project = make_project(tmp / "project")
    model_dir = project / "recipes/tiny_cpu/models/tiny-qwen3-moe"
    # save_pretrained writes the released checkpoints' layout (one tensor per expert): the
    # weight map stacks them into the custom model's fused experts, reading slices.
    _hf_model(model_dir).save_pretrained(model_dir)
    chain = []
    for name, accelerator in LAYOUTS.items():
        data = yaml.safe_load((project / TINY_RECIPE).read_text())
        data.update(codegen=False, modeling_backend="custom")
        data["model"]["init"] = "pretrained"
        data["accelerator"].update(nproc_per_node=2, **accelerator)
        data["training"].update(steps=STEPS, global_batch_size=4, micro_batch_size=2, seq_len=12)
        recipe = (project / TINY_RECIPE).with_name(f"custom_{name}.yaml")
        chain.append({"name": name, "recipe": str(recipe), "text": yaml.safe_dump(data, sort_keys=False),
                      "copies": [], "metrics": str(tmp / f"{name}.jsonl")})
    (tmp / "chain.json").write_text(json.dumps(chain))
    proc = torchrun(["-m", "tests.trainer.train_chain_worker", "--chain", str(tmp / "chain.json")], project,
                    nproc=2, preload=(QWEN3_MOE_MODELING,), env={"PYTHONPATH": str(REPO)})
    assert_ran(proc)
    reference = reference_training(chain[0]["recipe"])  # the same weights, data and AdamW for every layout
    return {run["name"]: read_metrics(run["metrics"]) for run in chain}, reference


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_custom_backend_trains_like_single_process_hf(trained, layout):
    results, want = trained
    got = results[layout]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4), (layout, step, got, want)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (layout, step, got, want)
