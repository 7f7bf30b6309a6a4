"""Shared by the family tests: tiny configs, random weights, one torchrun for many cases."""

import json
from pathlib import Path

import torch
import transformers
import yaml
from safetensors.torch import save_file

from tests.launch import assert_ran, torchrun
from tests.project_fixtures import cli

REPO = Path(__file__).resolve().parents[2]
FAMILY_CONFIGS = REPO / "tests/data/families"
HF_FAMILIES = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe")
FORMS = {"tp2": False, "tp2-sp": True}  # form name -> sequence_parallel
UNSEEN_FAMILY = "fused_decoder"  # tests/families/custom_decoder.py, a family no planner table knows



def save_random_hf_weights(config_dir: Path, path: Path, seed: int = 1234) -> Path:
    config = transformers.AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()}, str(path))
    return path


def run_cases(cases: list[dict], out: Path, timeout: int = 300) -> dict[str, list[dict]]:
    """Run every case in one torchrun (world 2); returns ``{name: [rank0 result, rank1 result]}``."""
    cases_file = out / "cases.json"
    cases_file.write_text(json.dumps(cases, indent=1))
    run = torchrun(["-m", "tests.families.family_worker", "--cases", str(cases_file), "--out", str(out)],
                   cwd=REPO, timeout=timeout)
    assert_ran(run)
    return {case["name"]: [json.loads((out / f"{case['name']}.rank{rank}.json").read_text()) for rank in (0, 1)]
            for case in cases}


def assert_equivalent(result: dict, form: str) -> None:
    """Loss (rtol 1e-5), every gathered gradient (in the worker: rtol 1e-4, atol 1e-6), three steps."""
    assert "error" not in result, result.get("traceback", result)
    assert result["applied_axes"] == (["tp", "sp"] if FORMS[form] else ["tp"]), result["applied_axes"]
    assert abs(result["par_loss"] - result["ref_loss"]) <= 1e-5 * abs(result["ref_loss"]), result
    assert result["grad_failures"] == [], result["grad_failures"]
    assert result["grads_checked"] == result["param_count"], result
    losses = result["train_losses"]
    assert losses["parallel"][-1] < losses["parallel"][0]  # the steps did something
    for ref, par in zip(losses["reference"], losses["parallel"], strict=True):
        assert abs(par - ref) <= 1e-5 * abs(ref), losses


def generate_tp2(project: Path, name: str, write_config) -> tuple[Path, str]:
    """A project with one tp2 recipe ``recipes/<name>/recipe.yaml`` whose model folder
    ``write_config(folder)`` fills; generate it (every stage, preflight included). Returns the recipe and
    the CLI's whole output; the caller asserts on it."""
    model_dir = project / "recipes" / name / "model"
    model_dir.mkdir(parents=True)
    (project / "dodo.py").write_bytes((REPO / "dodo.py").read_bytes())
    write_config(model_dir)
    recipe = model_dir.parent / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"pretrained_model_name_or_path": "model", "torch_dtype": "float32", "attn_implementation": "eager"},
        "accelerator": {"device_type": "cpu", "nproc_per_node": 2, "nnodes": 1, "tp_size": 2},
        "codegen": True,
        "training": {"steps": 1, "global_batch_size": 2, "micro_batch_size": 1, "seq_len": 16, "seed": 0},
        "optimizer": {"name": "adamw", "lr": 1.0e-3}}, sort_keys=False))
    proc = cli(project, "--verbose", "generate", "--config", str(recipe))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return recipe, out
