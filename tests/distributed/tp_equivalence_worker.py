"""torchrun worker: tensor-parallel tiny qwen3_moe vs the single-process HF model.

Run from the repo root::

    python -m torch.distributed.run --nproc_per_node=2 -m tests.distributed.tp_equivalence_worker \
        --config-dir recipes/tiny_cpu/models/tiny-qwen3-moe --weights W.safetensors --out OUT_DIR

Every rank builds the reference model and the parallel model from the same weights,
plans on a meta-device model, applies the plan (round-tripped through its JSON form,
keys compressed to globs) and writes ``OUT_DIR/rank<N>.json`` with what it measured.
"""

import argparse
import json
import re
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file

from hyper_parallel.distributed.applier import apply_sharding_plan
from hyper_parallel.distributed.mesh import MeshContext, ParallelDims, build_device_mesh, build_offline_mesh
from hyper_parallel.distributed.placement_text import local_shard_shape
from hyper_parallel.distributed.placements import named_from_placements
from hyper_parallel.distributed.plan_format import plan_modules_from_json, plan_modules_to_json
from hyper_parallel.distributed.planner import ShardingPlanner


def build_model(config, weights=None, device=None):
    with torch.device(device or "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                              dtype=torch.float32)
    if weights is not None:
        model.load_state_dict(weights, strict=True)
    return model


def compress_to_globs(plan_json: dict) -> dict:
    """Layer-indexed keys whose entries are identical become one ``layers.*`` key."""
    groups: dict[str, list[str]] = {}
    for key in plan_json:
        groups.setdefault(re.sub(r"\.\d+\.", ".*.", key), []).append(key)
    out = {}
    for pattern, keys in groups.items():
        entries = {json.dumps(plan_json[k]) for k in keys}
        if len(keys) > 1 and len(entries) == 1:
            out[pattern] = plan_json[keys[0]]
        else:
            out.update({k: plan_json[k] for k in keys})
    return out


def loss_of(model, batch):
    return model(input_ids=batch, labels=batch).loss


def meta_shape_mismatches(config, plan, device_mesh, dims) -> list[str]:
    """Apply the plan to a meta model and compare local shards with ``local_shard_shape``."""
    meta = build_model(config, device="meta")
    apply_sharding_plan(meta, plan, device_mesh)
    axes, sizes = device_mesh.mesh_dim_names, tuple(device_mesh.shape)
    coords = device_mesh.get_coordinate()
    bad = []
    for name, param in meta.named_parameters():
        sub_axes = param.device_mesh.mesh_dim_names
        named = named_from_placements(param.placements, sub_axes)
        expected = local_shard_shape(tuple(param.shape), named, axes, sizes, coords)
        if tuple(param.to_local().shape) != expected:
            bad.append(f"{name}: local {tuple(param.to_local().shape)} expected {expected}")
    return bad


def compare_grads(reference, parallel) -> tuple[list[str], int]:
    ref_params = dict(reference.named_parameters())
    failures, checked = [], 0
    for name, param in parallel.named_parameters():
        ref_grad = ref_params[name].grad
        if param.grad is None or ref_grad is None:
            if (param.grad is None) != (ref_grad is None):
                failures.append(f"{name}: grad is None on one side only")
            continue
        if tuple(param.grad.placements) != tuple(param.placements):
            failures.append(f"{name}: grad placements {param.grad.placements} != param {param.placements}")
        grad = param.grad.full_tensor()
        checked += 1
        if not torch.allclose(grad, ref_grad, rtol=1e-4, atol=1e-6):
            diff = (grad - ref_grad).abs().max().item()
            failures.append(f"{name}: max |diff| {diff:.3e} (placements {param.grad.placements})")
    return failures, checked


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config-dir", required=True)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dims = ParallelDims(tp=2)
    device_mesh = build_device_mesh(dims, "cpu")
    rank = dist.get_rank()
    config = transformers.AutoConfig.from_pretrained(args.config_dir)
    weights = load_file(args.weights)

    plan = ShardingPlanner(build_model(config, device="meta"), dims=dims, mesh=build_offline_mesh(dims)).plan()
    plan_json = compress_to_globs(plan_modules_to_json(plan.modules, plan.roles))
    frozen = plan_modules_from_json(json.loads(json.dumps(plan_json)))

    reference = build_model(config, weights)
    parallel = apply_sharding_plan(build_model(config, weights), frozen, MeshContext(device_mesh, dims))

    batch = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    ref_loss = loss_of(reference, batch)
    ref_loss.backward()
    par_loss = loss_of(parallel, batch)
    par_loss.backward()
    grad_failures, grads_checked = compare_grads(reference, parallel)

    steps = {}
    for model in (reference, parallel):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        steps = {"reference": loss_of(reference, batch).item(), "parallel": loss_of(parallel, batch).item()}

    result = {
        "rank": rank,
        "plan_keys": sorted(plan_json),
        "ref_loss": ref_loss.item(),
        "par_loss": par_loss.item(),
        "grad_failures": grad_failures,
        "grads_checked": grads_checked,
        "param_count": sum(1 for _ in parallel.named_parameters()),
        "dtensor_params": sum(1 for _, p in parallel.named_parameters() if hasattr(p, "placements")),
        "meta_shape_mismatches": meta_shape_mismatches(config, frozen, device_mesh, dims),
        "loss_after_step": steps,
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
