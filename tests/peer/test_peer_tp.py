"""The peer: transformers' own ``from_pretrained(dir, tp_plan="auto")`` at tp 2 under
torchrun (gloo, CPU) on the tiny qwen3_moe agrees with one process and with our
planner -> applier, in the same run."""

import json
import math

import pytest
import torch
import transformers

from tests.families.family_cases import REPO
from tests.launch import assert_ran, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CONFIG_DIR = REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"


def test_transformers_tp_plan_auto_agrees_with_one_process_and_with_us(tmp_path):
    model_dir = tmp_path / "tiny-qwen3-moe"
    torch.manual_seed(1234)
    config = transformers.AutoConfig.from_pretrained(CONFIG_DIR)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)

    run = torchrun(["-m", "tests.peer.peer_worker", "--model-dir", str(model_dir), "--out", str(tmp_path)],
                   cwd=REPO, timeout=300)
    assert_ran(run)

    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        losses = result["losses"]
        assert math.isclose(losses["peer"], losses["reference"], rel_tol=1e-5), losses
        assert math.isclose(losses["ours"], losses["reference"], rel_tol=1e-5), losses
        assert math.isclose(losses["ours"], losses["peer"], rel_tol=1e-5), losses
        # the peer really is tensor-parallel: attention and experts are split across the 2 ranks
        assert result["peer_tp_size"] == 2
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                     "model.layers.0.mlp.experts.gate_up_proj"):
            assert name in result["peer_sharded_params"], result["peer_sharded_params"]
        assert math.isclose(result["peer_grad_norm_q_proj"], result["reference_grad_norm_q_proj"], rel_tol=1e-4)
