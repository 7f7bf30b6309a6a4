"""Gradients that arrive ``Partial`` on a parameter placed ``Replicate`` (a replicated
weight whose work is split: q/k norms over heads, norms over the sequence), reduced
together when backward ends.

The parameter's post-accumulate hook only records it; one callback at the end of the
backward pass all-reduces every recorded gradient in one flat buffer per process
group, so ``param.grad`` has the parameter's placements before ``backward()`` returns,
with one collective instead of one per parameter.
"""

import threading

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

# Per thread: each rank of a threaded (simulated) world runs its own backward.
_local = threading.local()


def _pending_params() -> list[torch.Tensor]:
    if not hasattr(_local, "pending"):
        _local.pending = []
    return _local.pending


def reduce_partial_grad(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a DTensor parameter."""
    grad = param.grad
    if not isinstance(grad, DTensor) or tuple(grad.placements) == tuple(param.placements):
        return
    pending = _pending_params()
    if not pending:
        torch.autograd.Variable._execution_engine.queue_callback(_reduce_pending)
    pending.append(param)


def _summed_dims(grad_placements, param_placements) -> tuple[int, ...] | None:
    """Mesh dims where a partial sum becomes the replicated parameter's gradient; ``None``
    when the gradient needs some other redistribution."""
    dims = []
    for dim, (have, want) in enumerate(zip(grad_placements, param_placements)):
        if have == want:
            continue
        if isinstance(have, Partial) and have.reduce_op == "sum" and isinstance(want, Replicate):
            dims.append(dim)
            continue
        return None
    return tuple(dims)


def _reduce_pending() -> None:
    pending = _pending_params()
    params = list(pending)
    pending.clear()
    buckets: dict[tuple, tuple[list, list]] = {}
    for param in params:
        grad = param.grad
        if not isinstance(grad, DTensor) or tuple(grad.placements) == tuple(param.placements):
            continue
        dims = _summed_dims(grad.placements, param.placements)
        if dims is None:
            param.grad = grad.redistribute(param.device_mesh, param.placements)
            continue
        mesh = param.device_mesh
        groups = [mesh.get_group(dim) for dim in dims if mesh.size(dim) > 1]
        key = (grad.dtype, grad.device, tuple(id(group) for group in groups))
        buckets.setdefault(key, (groups, []))[1].append(param)
    for groups, members in buckets.values():
        flat = torch.cat([param.grad.to_local().reshape(-1) for param in members])
        for group in groups:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for param in members:
            local = param.grad.to_local()
            summed = flat[offset:offset + local.numel()].view(local.shape)
            offset += local.numel()
            param.grad = DTensor.from_local(summed, param.device_mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=summed.stride())
