"""The global gradient norm of a model spread over ranks, and clipping to it."""

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from hyper_parallel.platform.device import REDUCE_DTYPE
from hyper_parallel.platform.host_values import to_host_float


def global_grad_norm(parameters, pp: int = 1, device: torch.device | str | None = None) -> float:
    """L2 norm of all gradients, as one process holding the whole model would compute it.

    Every rank of a pipeline stage holds a part of every parameter of its stage (SPMD): a
    DTensor's local shard, or a plain tensor replicated on the stage's ranks. A part is
    held by ``world / pp / (ways it is sharded)`` ranks, so each rank adds its parts'
    squared norms divided by that count, and one all-reduce over every rank (every
    stage) sums them. Partial gradients are reduced first.

    On the run's device throughout (the gradients', or ``device`` where this rank has
    none): the parts' norms are torch's own ``get_total_norm`` (fused per device and
    dtype), summed in ``REDUCE_DTYPE`` (hccl reduces no float64), and the result is read
    back once. torch's norm is not taken over the DTensors themselves: a model's
    gradients live on several meshes (tp, the expert mesh, plain replicated tensors),
    which one stacked norm cannot mix."""
    world = dist.get_world_size() // pp
    parts: dict[int, list[torch.Tensor]] = {}  # copies -> local gradient pieces held that many times
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
        parts.setdefault(copies, []).append(grad.detach())
    where = next((grads[0].device for grads in parts.values()), device or "cpu")
    total = torch.zeros((), dtype=REDUCE_DTYPE, device=where)
    for copies, grads in parts.items():
        total += torch.nn.utils.get_total_norm(grads, norm_type=2.0).to(REDUCE_DTYPE).square() / copies
    dist.all_reduce(total)
    return math.sqrt(to_host_float(total))


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
