"""torchrun, world 2, tp 2: planner -> applier on tiny qwen3_moe equals single-process HF."""

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.launch import assert_ran, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"



def _save_random_weights(path: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(CONFIG_DIR)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()}, str(path))


def test_tp2_loss_grads_and_step_match_single_process(tmp_path):
    weights = tmp_path / "weights.safetensors"
    _save_random_weights(weights)
    run = torchrun(["-m", "tests.distributed.tp_equivalence_worker",
                    "--config-dir", str(CONFIG_DIR), "--weights", str(weights), "--out", str(tmp_path)],
                   cwd=REPO, timeout=300)
    assert_ran(run)

    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # the plan reached the applier as globs, one key per layer-invariant module
        assert "model.layers.*.mlp.experts" in result["plan_keys"]
        assert math.isclose(result["par_loss"], result["ref_loss"], rel_tol=1e-5), result
        assert result["grad_failures"] == [], result["grad_failures"]
        assert result["grads_checked"] == result["param_count"] == 25
        # split parameters are DTensors; replicated ones with whole inputs stay plain
        assert 0 < result["dtensor_params"] < 25, result
        assert result["meta_shape_mismatches"] == []
        after = result["loss_after_step"]
        assert after["parallel"] < result["par_loss"]  # the step did something
        assert math.isclose(after["parallel"], after["reference"], rel_tol=1e-5), after
