"""The tiny recipe's generated model, after its hyper_parallelize() at tp 2 under
torchrun, computes the single-process HF model's loss and gradients."""

import json
import math

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.launch import assert_ran, torchrun
from tests.pipeline.pipeline_helpers import BUNDLE, generated_tiny_project
from tests.project_fixtures import REPO

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CONFIG_DIR = REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"


def test_generated_bundle_at_tp2_equals_single_process_hf(tmp_path_factory, tmp_path):
    # The run's shared tiny project, generated through install (read only here).
    bundle = generated_tiny_project(tmp_path_factory) / BUNDLE

    config = transformers.AutoConfig.from_pretrained(CONFIG_DIR)
    torch.manual_seed(4321)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    weights = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))

    proc = torchrun(["-m", "tests.pipeline.generated_tp_worker",
                     "--bundle", str(bundle), "--config-dir", str(CONFIG_DIR), "--weights", str(weights),
                     "--out", str(tmp_path)], cwd=REPO)
    assert_ran(proc)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["generated_class_module"].startswith("hyper_parallel_generated."), result
        assert math.isclose(result["gen_loss"], result["ref_loss"], rel_tol=1e-5), result
        assert result["grad_failures"] == []
        assert result["grads_checked"] == result["param_count"] == 25
