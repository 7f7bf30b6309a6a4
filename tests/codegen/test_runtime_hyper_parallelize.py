"""The generated file's hyper_parallelize() under torchrun (world 2, tp 2) equals HF.

The test process plans and freezes the tiny Qwen3-MoE (fused-attention replacement
applied, as the derive stage does), emits the modeling file and launches this module
as the torchrun worker: each rank imports the emitted file, builds the model (its
``__init__`` applies the replacement), shards it with ``hyper_parallelize`` on a real
gloo mesh and compares loss and gradients with the single-process HF model.
"""

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from hyper_parallel.codegen.emit.modeling import emit_modeling_source
from hyper_parallel.config.layout import Layout
from hyper_parallel.config.plan_override import parse_plan_overrides, replacement_entries
from hyper_parallel.runtime import hyper_apply_replacements
from tests.launch import assert_ran, torchrun
from tests.rank_exit import leave_after_barrier

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"
SOURCE_MODULE = "transformers.models.qwen3_moe.modeling_qwen3_moe"
OVERRIDES = parse_plan_overrides([{
    "match": "*.self_attn", "module_type": f"{SOURCE_MODULE}.Qwen3MoeAttention",
    "replace_module": {"_target_": "hyper_parallel.models.qwen3_moe.adapter.replacements."
                                   "replace_qwen3_moe_flash_attention"}}])
REPLACEMENTS = replacement_entries(OVERRIDES)


def tiny_config():
    config = transformers.AutoConfig.from_pretrained(CONFIG_DIR)
    config._attn_implementation = "eager"
    return config


def frozen_tp2_plan() -> dict:
    from hyper_parallel.codegen.plan.freeze import freeze_plan
    from hyper_parallel.distributed.mesh import ParallelDims
    from hyper_parallel.distributed.plan_format import plan_modules_to_json
    from hyper_parallel.planning.planner import ShardingPlanner

    dims = ParallelDims(tp=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_config())
    hyper_apply_replacements(model, REPLACEMENTS)
    result = ShardingPlanner(model, Layout(dims)).plan()
    return freeze_plan({"format": 2, "layout": Layout(dims).as_dict(),
                        "applied_axes": list(result.applied_axes), "recorded_axes": dict(result.recorded_axes),
                        "modules": plan_modules_to_json(result.modules, result.roles)},
                       [name for name, _ in model.named_modules()])



def test_generated_hyper_parallelize_matches_hf_under_torchrun(tmp_path):
    plan = frozen_tp2_plan()
    assert "model.layers.*.self_attn.[qkv]_proj" in plan["modules"]  # q, k and v: one class key
    source = Path(importlib.util.find_spec(SOURCE_MODULE).origin).read_text(encoding="utf-8")
    banner = {"recipe": "recipes/tiny_cpu/qwen3_moe_tiny.yaml", "signature": "test", "source_sha256": "test",
              "transformers_version": transformers.__version__, "parallel_dims": {"tp": 2}}
    generated = tmp_path / "modeling_Qwen3_Moe_gen_cpu.py"
    generated.write_text(emit_modeling_source(source_text=source, source_module=SOURCE_MODULE, banner=banner,
                                              frozen_plan=plan, overrides=OVERRIDES), encoding="utf-8")
    torch.manual_seed(1234)
    reference = transformers.AutoModelForCausalLM.from_config(tiny_config())
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(tmp_path / "w.safetensors"))

    run = torchrun(["-m", "tests.codegen.test_runtime_hyper_parallelize",
                    "--generated", str(generated), "--weights", str(tmp_path / "w.safetensors"), "--out", str(tmp_path)],
                   cwd=REPO, timeout=300)
    assert_ran(run)

    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["fused_attention_layers"] == 2
        # split parameters are DTensors; replicated ones whose module sees whole inputs and
        # converts nothing (norms, the router at tp without sp) stay plain tensors
        assert 0 < result["dtensor_params"] < result["param_count"]
        assert result["sharded_q_proj_local_rows"] == 32  # 4 heads * 16 / tp 2
        assert math.isclose(result["loss"], result["ref_loss"], rel_tol=1e-5), result
        assert result["grads_checked"] == result["param_count"]
        assert result["grad_failures"] == []


# --- the torchrun worker ----------------------------------------------------------------------


def _import_generated(path: Path):
    name = f"_hyper_test_generated_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _worker(generated: Path, weights: Path, out: Path) -> None:
    import torch.distributed as dist

    from hyper_parallel.distributed.mesh import MeshContext, ParallelDims, build_device_mesh
    from hyper_parallel.models.qwen3_moe.adapter.replacements import Qwen3MoeFusedAttention

    dims = ParallelDims(tp=2)
    mesh = build_device_mesh(dims, "cpu")
    module = _import_generated(generated)
    state = load_file(str(weights))
    reference = transformers.AutoModelForCausalLM.from_config(tiny_config())
    reference.load_state_dict(state)
    model = module.Qwen3MoeForCausalLM(tiny_config())
    model.load_state_dict(state)
    assert module.hyper_parallelize(model, MeshContext(mesh, Layout(dims))) is model

    batch = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(7))
    ref_loss = reference(input_ids=batch, labels=batch).loss
    ref_loss.backward()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()

    ref_params = dict(reference.named_parameters())
    failures, checked = [], 0
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        checked += 1
        if not torch.allclose(grad, ref_params[name].grad, rtol=1e-4, atol=1e-6):
            failures.append(f"{name}: max |diff| {(grad - ref_params[name].grad).abs().max().item():.3e}")
    result = {
        "loss": loss.item(), "ref_loss": ref_loss.item(), "grad_failures": failures, "grads_checked": checked,
        "param_count": sum(1 for _ in model.parameters()),
        "dtensor_params": sum(1 for p in model.parameters() if hasattr(p, "placements")),
        "fused_attention_layers": sum(isinstance(layer.self_attn, Qwen3MoeFusedAttention)
                                      for layer in model.model.layers),
        "sharded_q_proj_local_rows": model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0],
    }
    out.joinpath(f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    leave_after_barrier(dist)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--generated", type=Path, required=True)
    parser.add_argument("--weights", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    _worker(args.generated, args.weights, args.out)
