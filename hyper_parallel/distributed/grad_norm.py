"""The global gradient norm of a model spread over ranks, and clipping to it."""

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def global_grad_norm(parameters, pp: int = 1) -> float:
    """L2 norm of all gradients, as one process holding the whole model would compute it.

    Every rank of a pipeline stage holds a part of every parameter of its stage (SPMD): a
    DTensor's local shard, or a plain tensor replicated on the stage's ranks. A part is
    held by ``world / pp / (ways it is sharded)`` ranks, so each rank adds its parts'
    squared norms divided by that count, and one all-reduce over every rank (every
    stage) sums them. Partial gradients are reduced first."""
    world = dist.get_world_size() // pp
    total = torch.zeros((), dtype=torch.float64)
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        copies = world
        if isinstance(grad, DTensor):
            if any(placement.is_partial() for placement in grad.placements):
                grad = grad.redistribute(placements=[Replicate() if placement.is_partial() else placement
                                                     for placement in grad.placements])
            # Every placement left is a shard of some kind (Shard, _StridedShard, ...).
            ways = math.prod(grad.device_mesh.size(dim) for dim, placement in enumerate(grad.placements)
                             if not placement.is_replicate())
            copies, grad = world // ways, grad.to_local()
        total += grad.detach().double().pow(2).sum().cpu() / copies
    dist.all_reduce(total)
    return math.sqrt(total.item())


def clip_grads_to(parameters, total_norm: float, max_norm: float) -> None:
    """Scale every gradient by ``max_norm / total_norm`` when the norm exceeds it, as
    ``torch.nn.utils.clip_grad_norm_`` does (same coefficient, same epsilon)."""
    coefficient = max_norm / (total_norm + 1e-6)
    if coefficient >= 1.0:
        return
    with torch.no_grad():
        for param in parameters:
            if param.grad is not None:
                param.grad.mul_(coefficient)
