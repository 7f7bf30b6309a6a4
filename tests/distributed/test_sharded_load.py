"""Each rank reads only its own shards from safetensors, and the model is the HF model."""

import math
import shutil

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.batch_launch import Batches
from tests.launch import torchrun
from tests.project_fixtures import REPO

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CONFIG_DIR = REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"


def _per_expert(state: dict) -> dict:
    """HF's per-expert checkpoint layout (what Qwen3-MoE checkpoints on disk use)."""
    out = {}
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up[e].contiguous()
        elif leaf == "down_proj" and tensor.dim() == 3:
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e].contiguous()
        else:
            out[name] = tensor.contiguous()
    return out


LAYOUTS = ("fused", "per_expert")


def _model_dir(model_dir, layout: str):
    """The tiny model's config, its random weights whole (``reference.safetensors.ref``)
    and as the checkpoint in ``layout``."""
    model_dir.mkdir(parents=True)
    shutil.copy(CONFIG_DIR / "config.json", model_dir)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(99)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(model_dir / "reference.safetensors.ref"))
    save_file(_per_expert(state) if layout == "per_expert" else state, str(model_dir / "model.safetensors"))
    return model_dir


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """Both checkpoint layouts loaded by the same two ranks, one after the other (one
    launch; tests/batch_launch.py), each test reading its own layout's results."""
    root = tmp_path_factory.mktemp("sharded_load")
    cases = {layout: (2, ["--model-dir", str(_model_dir(root / layout / "model", layout))]) for layout in LAYOUTS}

    def launch(world: int, out, cases_file):
        return torchrun(["-m", "tests.distributed.sharded_load_worker", "--cases", str(cases_file),
                         "--out", str(out)], cwd=REPO, nproc=world)

    return Batches(root / "out", cases, launch)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tp2_sharded_load_equals_hf_and_reads_less(batches, layout):
    for result in batches.results(layout):
        assert math.isclose(result["loss"], result["ref_loss"], rel_tol=1e-5), result
        assert result["grad_failures"] == [], result["grad_failures"]
        assert result["grads_checked"] == 25
        # tp shards everything but norms and the router: well under the full size is read and kept
        assert result["bytes_read"] == result["local_param_bytes"]
        assert result["local_param_bytes"] < 0.6 * result["full_param_bytes"], result
