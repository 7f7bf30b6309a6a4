"""The two module-boundary conversions that are one collective each, without DTensor.

A plan's boundary conversion is ``from_local(src) -> redistribute(dst) -> to_local(grad)``.
Most boundaries move no data forward and differ only in what the gradient must be:

- a replicated input to a module whose work is split (a colwise projection, the
  experts): identity forward, the input gradient all-reduced backward;
- a partial sum handed on replicated (rowwise / experts output): all-reduce forward,
  identity backward (the replicated gradient is every piece's gradient).

Doing these through DTensor costs three autograd nodes and its placement bookkeeping
per tensor; these functions do exactly the same collectives with one node.
``boundary_reductions`` says, per mesh axis, whether a conversion is one of these (or
moves nothing at all), so the applier can take this path and leave the rest to DTensor.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate



def _is_sum(placement) -> bool:
    return isinstance(placement, Partial) and placement.reduce_op == "sum"


def _summed(tensor: torch.Tensor, groups) -> torch.Tensor:
    out = tensor.clone(memory_format=torch.contiguous_format)  # the caller's tensor stays as it was
    for group in groups:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


class _AllReduceInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, groups):
        ctx.groups = groups
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None if grad is None else _summed(grad, ctx.groups)), None


class _AllReduceInForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, groups):
        return _summed(tensor, groups)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def all_reduce_in_backward(tensor: torch.Tensor, groups) -> torch.Tensor:
    if not groups or not tensor.requires_grad:
        return tensor
    return _AllReduceInBackward.apply(tensor, tuple(groups))


def all_reduce_in_forward(tensor: torch.Tensor, groups) -> torch.Tensor:
    if not groups:
        return tensor
    return _AllReduceInForward.apply(tensor, tuple(groups))


def input_reductions(src: tuple, dst: tuple, grad: tuple) -> tuple[int, ...] | None:
    """Mesh dims whose input gradient is all-reduced, for an input conversion that moves
    no data forward; ``None`` when the conversion is anything else.

    Per dim the gradient ``grad`` is sent back to ``src`` (a partial forward placement's
    gradient is replicate, as DTensor's ``from_local`` has it): equal is nothing to do,
    partial -> replicate is an all-reduce."""
    if src != dst:
        return None
    reduce = []
    for dim, (placement, wanted) in enumerate(zip(src, grad)):
        back_to = Replicate() if isinstance(placement, Partial) else placement
        if wanted == back_to:
            continue
        if _is_sum(wanted) and isinstance(back_to, Replicate):
            reduce.append(dim)
            continue
        return None
    return tuple(reduce)


def output_reductions(src: tuple, dst: tuple) -> tuple[int, ...] | None:
    """Mesh dims all-reduced forward for an output handed on as a local tensor (its
    gradient arrives replicated where the output was partial); ``None`` when the
    conversion moves data some other way."""
    reduce = []
    for dim, (placement, wanted) in enumerate(zip(src, dst)):
        if placement == wanted:
            continue
        if _is_sum(placement) and isinstance(wanted, Replicate):
            reduce.append(dim)
            continue
        return None
    return tuple(reduce)
