"""torchrun worker: tensor-parallel tiny qwen3_moe vs the single-process HF model.

Run from the repo root::

    python -m torch.distributed.run --nproc_per_node=2 -m tests.distributed.tp_equivalence_worker \
        --config-dir recipes/tiny_cpu/models/tiny-qwen3-moe --weights W.safetensors --out OUT_DIR

Every rank builds the reference model and the parallel model from the same weights,
plans on a meta-device model, applies the plan (round-tripped through its JSON form,
keys compressed to globs) and writes ``OUT_DIR/rank<N>.json`` with what it measured.

``--cases FILE`` runs several forms in turn in the same processes (one launch instead
of one per form; every form of a batch has the same world size): FILE is a JSON object
``{name: [flags...]}`` (the flags after ``--config-dir``, ``--weights`` and ``--out``);
every rank runs every form in the file's order, each on a fresh mesh and fresh models,
and writes ``OUT_DIR/<name>/rank<N>.json``. A form that raises writes
``OUT_DIR/<name>/error_rank<N>.txt`` (its traceback) and ends the rank with exit code 1
(its peers may be inside a collective it will never join), so the forms after it have
no results and the test names the one that failed.
"""

import argparse
import json
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
import transformers
from safetensors.torch import load_file

from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.applier import apply_sharding_plan
from hyper_parallel.distributed.fsdp import fully_shard_over_dp
from hyper_parallel.distributed.mesh import MeshContext, ParallelDims, build_device_mesh
from hyper_parallel.distributed.plan_format import plan_modules_from_json, plan_modules_to_json
from hyper_parallel.planning.planner import ShardingPlanner
from hyper_parallel.protocols.placement_text import local_shard_shape
from hyper_parallel.protocols.placements import placement_to_text
from tests.batch_worker import run_cases
from tests.rank_exit import leave_after_barrier


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


def start_tp2_worker(*flags: str) -> tuple[argparse.Namespace, MeshContext]:
    """The common start of the world-2 workers: their (required) flags, then a tp 2 mesh."""
    parser = argparse.ArgumentParser()
    for flag in flags:
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    dims = ParallelDims(tp=2)
    return args, MeshContext(build_device_mesh(dims, "cpu"), Layout(dims))


def loss_of(model, batch):
    return model(input_ids=batch, labels=batch).loss


def one_step_against_reference(reference, model, vocab_size: int, *, seq_len: int, seed: int):
    """Loss and backward of both models on one random batch; then their gradients
    compared. Returns (reference loss, model loss, gradient failures, gradients checked)."""
    batch = torch.randint(0, vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seed))
    ref_loss = loss_of(reference, batch)
    ref_loss.backward()
    loss = loss_of(model, batch)
    loss.backward()
    failures, checked = compare_grads(reference, model)
    return ref_loss, loss, failures, checked


class DataParallelLoss:
    """The trainer's side of dp: each dp rank takes its rows of the global batch and
    normalises by the global number of label tokens, so the dp ranks' losses sum to
    HF's loss on the whole batch. FSDP2 averages gradients over dp, so the backward
    runs on ``dp_size * loss`` (gloo has no pre-scaled sum to make FSDP2 just sum)."""

    def __init__(self, dp_mesh):
        self.group, self.size, self.rank = dp_mesh.get_group(), dp_mesh.size(), dp_mesh.get_local_rank()

    def __call__(self, model, batch):
        rows = batch.chunk(self.size)[self.rank]
        labelled = batch.shape[0] * (batch.shape[1] - 1)  # HF shifts labels: the last position has none
        return model(input_ids=rows, labels=rows, num_items_in_batch=torch.tensor(labelled)).loss

    def total(self, loss) -> float:
        value = loss.detach().clone()
        dist.all_reduce(value, group=self.group)
        return value.item()


def meta_shape_mismatches(config, plan, mesh_context) -> list[str]:
    """Apply the plan to a meta model and compare local shards with ``local_shard_shape``
    on each parameter's own (sub-)mesh (the expert mesh for expert-parallel weights)."""
    meta = build_model(config, device="meta")
    apply_sharding_plan(meta, plan, mesh_context)
    bad = []
    for name, param in meta.named_parameters():
        if not isinstance(param, DTensor):
            continue  # placed on no axis of more than one rank: whole on every rank
        sub_mesh = param.device_mesh
        named = {axis: placement_to_text(p) for axis, p in zip(sub_mesh.mesh_dim_names, param.placements)}
        expected = local_shard_shape(tuple(param.shape), named, sub_mesh.mesh_dim_names, tuple(sub_mesh.shape),
                                     sub_mesh.get_coordinate())
        if tuple(param.to_local().shape) != expected:
            bad.append(f"{name}: local {tuple(param.to_local().shape)} expected {expected}")
    return bad


def local_logits_shape(model, batch) -> list[int]:
    with torch.no_grad():
        return list(model(input_ids=batch).logits.shape)


def compare_grads(reference, parallel) -> tuple[list[str], int]:
    ref_params = dict(reference.named_parameters())
    failures, checked = [], 0
    for name, param in parallel.named_parameters():
        ref_grad = ref_params[name].grad
        if param.grad is None or ref_grad is None:
            if (param.grad is None) != (ref_grad is None):
                failures.append(f"{name}: grad is None on one side only")
            continue
        if isinstance(param, DTensor) and tuple(param.grad.placements) != tuple(param.placements):
            failures.append(f"{name}: grad placements {param.grad.placements} != param {param.placements}")
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        checked += 1
        if not torch.allclose(grad, ref_grad, rtol=1e-4, atol=1e-6):
            diff = (grad - ref_grad).abs().max().item()
            failures.append(f"{name}: max |diff| {diff:.3e} (placements {getattr(param.grad, 'placements', 'plain')})")
    return failures, checked


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--config-dir", required=True)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", help="JSON file {name: [flags...]}: run these forms in turn")
    for axis in ("dp", "cp", "tp", "ep"):
        parser.add_argument(f"--{axis}", type=int, default=2 if axis == "tp" else 1)
    parser.add_argument("--sp", action="store_true", help="sequence parallel")
    parser.add_argument("--loss-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=12)
    return parser.parse_args(argv)


def train_steps(reference, parallel, batch, steps: int, data_parallel=None) -> dict:
    """Forward/backward/AdamW on both models; grads compared after the first backward."""
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in (reference, parallel)]
    losses = {"reference": [], "parallel": []}
    grad_failures, grads_checked = [], 0
    for step in range(steps):
        ref_loss = loss_of(reference, batch)
        ref_loss.backward()
        losses["reference"].append(ref_loss.item())
        par_loss = (data_parallel or loss_of)(parallel, batch)
        (par_loss * (data_parallel.size if data_parallel else 1)).backward()
        losses["parallel"].append(data_parallel.total(par_loss) if data_parallel else par_loss.item())
        if step == 0:
            grad_failures, grads_checked = compare_grads(reference, parallel)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return {"losses": losses, "grad_failures": grad_failures, "grads_checked": grads_checked}


def main() -> None:
    args = parse_args()
    if args.cases is None:
        result = run_form(args)
        Path(args.out, f"rank{result['rank']}.json").write_text(json.dumps(result, indent=1))
    else:
        common = ["--config-dir", args.config_dir, "--weights", args.weights, "--out", args.out]
        run_cases(args.cases, args.out, lambda flags: run_form(parse_args([*common, *flags])))
    leave_after_barrier(dist)


def run_form(args) -> dict:
    """One form: a fresh mesh (a new DeviceMesh over the same process group), fresh models
    from the same weights, three steps on both; what this rank measured."""
    dims = ParallelDims(dp=args.dp, cp=args.cp, tp=args.tp, ep=args.ep)
    device_mesh = build_device_mesh(dims, "cpu")
    rank = dist.get_rank()
    config = transformers.AutoConfig.from_pretrained(args.config_dir)
    weights = load_file(args.weights)

    layout = Layout(dims, sequence_parallel=args.sp, loss_parallel=args.loss_parallel)
    plan = ShardingPlanner(build_model(config, device="meta"), layout).plan()
    plan_json = compress_to_globs(plan_modules_to_json(plan.modules, plan.roles))
    frozen = plan_modules_from_json(json.loads(json.dumps(plan_json)))

    reference = build_model(config, weights)
    mesh_context = MeshContext(device_mesh, Layout(dims))
    parallel = apply_sharding_plan(build_model(config, weights), frozen, mesh_context)
    data_parallel = None
    if dims.dp > 1:
        fully_shard_over_dp(parallel, device_mesh["dp"])
        data_parallel = DataParallelLoss(device_mesh["dp"])

    batch = torch.randint(0, config.vocab_size, (2, args.seq_len), generator=torch.Generator().manual_seed(7))
    trained = train_steps(reference, parallel, batch, args.steps, data_parallel)
    losses = trained["losses"]
    result = {
        "rank": rank,
        "plan_keys": sorted(plan_json),
        "applied_axes": plan.applied_axes,
        "recorded_axes": sorted(plan.recorded_axes),
        "ref_loss": losses["reference"][0],
        "par_loss": losses["parallel"][0],
        "losses": losses,
        "grad_failures": trained["grad_failures"],
        "grads_checked": trained["grads_checked"],
        "param_count": sum(1 for _ in parallel.named_parameters()),
        "dtensor_params": sum(1 for _, p in parallel.named_parameters() if hasattr(p, "placements")),
        "meta_shape_mismatches": meta_shape_mismatches(config, frozen, mesh_context),
        "loss_after_step": {"reference": losses["reference"][1], "parallel": losses["parallel"][1]},
        "local_logits_shape": local_logits_shape(parallel, batch.chunk(dims.dp)[device_mesh["dp"].get_local_rank()]),
        "expert_local_shape": list(parallel.get_submodule("model.layers.0.mlp.experts").down_proj.to_local().shape),
        "sharded_loss": not isinstance(parallel.loss_function, type(reference.loss_function)),
    }
    return result


if __name__ == "__main__":
    main()
