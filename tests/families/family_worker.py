"""torchrun worker: several model families, each planned -> applied at tp 2, vs the
single-process model with the same weights. One torchrun start serves every case.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.families.family_worker \
        --cases CASES.json --out OUT_DIR

CASES.json is a list of ``{"name", "builder", "config_dir", "weights", "sequence_parallel"}``;
``builder`` is ``"hf"`` (AutoModelForCausalLM from ``config_dir``) or ``"module:function"``
taking the config directory. Each case writes ``OUT_DIR/<name>.rank<N>.json``; a case
that raises records the error there instead, so the other cases still run.
"""

import argparse
import importlib
import json
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file

from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.applier import apply_sharding_plan
from hyper_parallel.distributed.mesh import MeshContext, ParallelDims, build_device_mesh
from hyper_parallel.distributed.plan_format import plan_modules_from_json, plan_modules_to_json
from hyper_parallel.planning.planner import ShardingPlanner
from tests.distributed.tp_equivalence_worker import compare_grads, compress_to_globs
from tests.rank_exit import leave_after_barrier

OPTIMIZER_STEPS = 3


def build(case: dict, device: str = "cpu", weights: dict | None = None) -> torch.nn.Module:
    if case["builder"] == "hf":
        config = transformers.AutoConfig.from_pretrained(case["config_dir"])
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                                  dtype=torch.float32)
    else:
        module_name, _, function = case["builder"].partition(":")
        with torch.device(device):
            model = getattr(importlib.import_module(module_name), function)(case["config_dir"])
    if weights is not None:
        model.load_state_dict(weights, strict=True)
    return model


def loss_of(model, batch) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def train_losses(model, batch) -> list[float]:
    """Loss before each of OPTIMIZER_STEPS AdamW steps, then after the last one."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(OPTIMIZER_STEPS):
        optimizer.zero_grad()
        loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        losses.append(loss_of(model, batch).item())
    return losses


def run_case(case: dict, device_mesh, dims: ParallelDims) -> dict:
    weights = load_file(case["weights"])
    sequence_parallel = bool(case.get("sequence_parallel"))
    planned = ShardingPlanner(build(case, "meta"), Layout(dims, sequence_parallel=sequence_parallel)).plan()
    plan_json = compress_to_globs(plan_modules_to_json(planned.modules, planned.roles))
    frozen = plan_modules_from_json(json.loads(json.dumps(plan_json)))  # exactly what a bundle holds

    reference = build(case, weights=weights)
    parallel = apply_sharding_plan(build(case, weights=weights), frozen, MeshContext(device_mesh, Layout(dims)))
    vocab = reference.get_input_embeddings().num_embeddings
    batch = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(7))

    ref_loss, par_loss = loss_of(reference, batch), loss_of(parallel, batch)
    ref_loss.backward()
    par_loss.backward()
    grad_failures, grads_checked = compare_grads(reference, parallel)
    for model in (reference, parallel):
        model.zero_grad(set_to_none=True)
    return {
        "roles": planned.roles,
        "applied_axes": planned.applied_axes,
        "ref_loss": ref_loss.item(),
        "par_loss": par_loss.item(),
        "grad_failures": grad_failures,
        "grads_checked": grads_checked,
        "param_count": sum(1 for _ in parallel.parameters()),
        "sharded_params": sorted(name for name, p in parallel.named_parameters()
                                 if any(not pl.is_replicate() for pl in getattr(p, "placements", ()))),
        "train_losses": {"reference": train_losses(reference, batch), "parallel": train_losses(parallel, batch)},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dims = ParallelDims(tp=2)
    device_mesh = build_device_mesh(dims, "cpu")
    rank = dist.get_rank()
    for case in json.loads(Path(args.cases).read_text()):
        try:
            result = run_case(case, device_mesh, dims)
        except Exception as exc:  # recorded per case: one broken family must not hide the others
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        Path(args.out, f"{case['name']}.rank{rank}.json").write_text(json.dumps(result, indent=1))
        dist.barrier()
    leave_after_barrier(dist)


if __name__ == "__main__":
    main()
