"""torchrun worker (world 2): transformers' own tensor parallel (``from_pretrained(dir,
tp_plan="auto")``), our planner -> applier, and the single-process model, all on the
same tiny checkpoint, in the same run.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.peer.peer_worker --model-dir D --out OUT_DIR
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from hyper_parallel.distributed.applier import apply_sharding_plan
from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.mesh import MeshContext
from hyper_parallel.planning.planner import ShardingPlanner
from tests.distributed.tp_equivalence_worker import loss_of, start_tp2_worker
from tests.rank_exit import leave_after_barrier


def load(model_dir: str, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                                             dtype=torch.float32, **kwargs)


def ours(model_dir: str, mesh_context: MeshContext):
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    dims = mesh_context.dims
    plan = ShardingPlanner(meta, Layout(dims)).plan()
    return apply_sharding_plan(load(model_dir), plan.modules, mesh_context)


def main() -> None:
    args, mesh_context = start_tp2_worker("--model-dir", "--out")
    peer = load(args.model_dir, tp_plan="auto")
    parallel = ours(args.model_dir, mesh_context)
    reference = load(args.model_dir)

    vocab = reference.config.vocab_size
    batch = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(5))
    losses = {name: loss_of(model, batch) for name, model in
              (("reference", reference), ("peer", peer), ("ours", parallel))}
    for loss in losses.values():
        loss.backward()
    peer_params = dict(peer.named_parameters())
    result = {
        "losses": {name: loss.item() for name, loss in losses.items()},
        "peer_tp_size": getattr(peer, "tp_size", None),
        "peer_sharded_params": sorted(
            name for name, p in peer_params.items()
            if any(not pl.is_replicate() for pl in getattr(p, "placements", ())) or p.shape != dict(
                reference.named_parameters())[name].shape),
        "peer_grad_norm_q_proj": _grad_norm(peer_params["model.layers.0.self_attn.q_proj.weight"]),
        "reference_grad_norm_q_proj": _grad_norm(
            dict(reference.named_parameters())["model.layers.0.self_attn.q_proj.weight"]),
    }
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    leave_after_barrier(dist)


def _grad_norm(param) -> float:
    grad = param.grad
    if hasattr(grad, "full_tensor"):
        grad = grad.full_tensor()
    return grad.norm().item()


if __name__ == "__main__":
    main()
