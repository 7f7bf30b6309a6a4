"""The two module-boundary conversions that are one collective each, without DTensor.

A plan's boundary conversion is ``from_local(src) -> redistribute(dst) -> to_local(grad)``.
Most boundaries move no data forward and differ only in what the gradient must be:

- a replicated input to a module whose work is split (a colwise projection, the
  experts): identity forward, the input gradient all-reduced backward;
- a partial sum handed on replicated (rowwise / experts output): all-reduce forward,
  identity backward (the replicated gradient is every piece's gradient).

Doing these through DTensor costs three autograd nodes and its placement bookkeeping
per tensor; these functions do exactly the same collectives with one node.
``input_reductions`` / ``output_reductions`` say whether a conversion is one of these
(or moves nothing at all), so the applier takes this path and leaves the rest to DTensor.

One tensor handed to several such modules (the q, k and v projections, gate and up)
is converted once per forward (``SharedInputReductions``): their gradients add up
locally and one all-reduce sums the total, instead of one all-reduce each.
"""

import weakref

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


def all_reduce_in_forward(tensor: torch.Tensor, groups) -> torch.Tensor:
    if not groups:
        return tensor
    return _AllReduceInForward.apply(tensor, tuple(groups))


class SharedInputReductions:
    """Per model: the input tensors converted in this forward, so modules sharing an input
    share its gradient all-reduce. ``clear`` runs when the model's forward starts and ends."""

    _MAX_ENTRIES = 256  # a model whose root forward never runs must not grow this forever

    def __init__(self):
        self._entries: dict[tuple, tuple] = {}

    def clear(self, *_args, **_kwargs) -> None:
        self._entries.clear()

    def all_reduce_in_backward(self, tensor: torch.Tensor, groups) -> torch.Tensor:
        if not groups or not tensor.requires_grad:
            return tensor
        if torch.compiler.is_compiling():
            # Under torch.compile each consumer reduces its own share (the same sum, one
            # all-reduce per consumer): a cache of traced tensors would become extra graph
            # outputs aliasing their inputs, which torch refuses beside DTensor parameters.
            return _AllReduceInBackward.apply(tensor, tuple(groups))
        key = (id(tensor), tuple(id(group) for group in groups), torch.is_grad_enabled())
        hit = self._entries.get(key)
        if hit is not None and hit[0]() is tensor:  # the same live tensor, not a reused id
            return hit[1]
        if len(self._entries) >= self._MAX_ENTRIES:
            self._entries.clear()
        converted = _AllReduceInBackward.apply(tensor, tuple(groups))
        self._entries[key] = (weakref.ref(tensor), converted)
        return converted


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


def output_shares(src: tuple, dst: tuple) -> tuple[int, ...] | None:
    """Mesh dims where a replicated output is handed on as a partial sum (an identity
    expert inside experts whose output is all-reduced); ``None`` when the conversion is
    anything else, or nothing."""
    shares = []
    for dim, (placement, wanted) in enumerate(zip(src, dst)):
        if placement == wanted:
            continue
        if isinstance(placement, Replicate) and _is_sum(wanted):
            shares.append(dim)
            continue
        return None
    return tuple(shares) or None


def first_rank_share(tensor: torch.Tensor, coordinate: list[int], mesh_dims: tuple[int, ...]) -> torch.Tensor:
    """A replicated value as one term of a sum over ``mesh_dims``: the first rank of them
    keeps it whole, the others hand on zeros (``tensor * 0``, so their gradient is zero).
    The sum counts the value once, and so does the gradient the input's boundary sums:
    exact for any size, where dividing by it (DTensor's Replicate -> Partial, transformers'
    ``moe_identity_expert``) rounds unless the size is a power of two."""
    first = all(coordinate[dim] == 0 for dim in mesh_dims)
    return tensor if first else tensor * 0
