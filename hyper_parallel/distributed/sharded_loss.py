"""Causal-LM cross entropy on sharded logits: vocab-parallel and/or sequence-split.

When a plan leaves the output embedding's logits sharded — over the vocab (loss
parallel: ``shard(-1)`` on tp) and/or over the sequence (context parallel:
``shard(1)`` on cp) — the applier replaces the model's ``loss_function`` (HF's
``ForCausalLM`` calls ``self.loss_function(logits, labels, vocab_size, **kwargs)``
inside ``forward``) with ``sharded_causal_lm_loss`` bound to the mesh:

- labels arrive whole on every rank; they are shifted as HF does, then each rank
  keeps the sequence piece its logits cover;
- log-sum-exp and the target logit are summed over the vocab ranks (the max used for
  stability is exchanged without gradient: it cancels out of the result);
- the per-token losses are summed over the sequence ranks and divided by HF's
  denominator (``num_items_in_batch`` when given, else the number of labels that are
  not ``ignore_index``), so the value equals HF's ``ForCausalLMLoss``.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def is_sequence_dim(placement, ndim: int = 3) -> bool:
    return isinstance(placement, Shard) and placement.dim % ndim == 1


def is_vocab_dim(placement, ndim: int = 3) -> bool:
    return isinstance(placement, Shard) and placement.dim % ndim == ndim - 1


def make_sharded_loss(sub_mesh, axes: tuple[str, ...], placements: tuple, *, order=None) -> "functools.partial":
    """The loss for logits laid out as ``placements`` (one per axis of ``sub_mesh``);
    ``order``: the load-balanced sequence order of the cp split (``context_parallel``)."""
    seq_axes = tuple(axis for axis, p in zip(axes, placements) if is_sequence_dim(p))
    vocab_axes = tuple(axis for axis, p in zip(axes, placements) if is_vocab_dim(p))
    if len(vocab_axes) > 1:
        raise ValueError(f"logits sharded over the vocab on several axes {vocab_axes}; one is supported")
    return functools.partial(sharded_causal_lm_loss, sub_mesh=sub_mesh, axes=axes, seq_axes=seq_axes,
                             vocab_axis=vocab_axes[0] if vocab_axes else None, order=order)


def sharded_causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index: int = -100,
                           shift_labels=None, *, sub_mesh, axes, seq_axes, vocab_axis, order=None, **kwargs):
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    denominator = num_items_in_batch if num_items_in_batch is not None else (shift_labels != ignore_index).sum()
    shift_labels = _local_sequence(shift_labels.to(logits.device), sub_mesh, axes, seq_axes, order)
    logits = logits.float()
    if vocab_axis is None:
        per_token = F.cross_entropy(logits.flatten(0, -2), shift_labels.flatten(), ignore_index=ignore_index,
                                    reduction="none").view(shift_labels.shape)
    else:
        per_token = _vocab_parallel_cross_entropy(logits, shift_labels, ignore_index, sub_mesh, axes, vocab_axis)
    local_sum = torch.where(shift_labels != ignore_index, per_token, 0.0).sum()
    total = _sum_over(local_sum, sub_mesh, axes, seq_axes)
    if torch.is_tensor(denominator):
        denominator = denominator.to(total.device)
    return total / denominator


def _local_sequence(labels: torch.Tensor, sub_mesh, axes, seq_axes, order=None) -> torch.Tensor:
    """This rank's piece of dim 1, split over ``seq_axes`` in mesh order (DTensor's nesting);
    over cp in the load-balanced ``order`` when given (the logits' order)."""
    for axis in axes:
        if axis in seq_axes:
            if axis == "cp" and order is not None:
                labels = order.permute(labels, 1)
            size, coord = sub_mesh.size(axes.index(axis)), sub_mesh.get_local_rank(axis)
            if labels.shape[1] % size:
                raise ValueError(f"sequence length {labels.shape[1]} of the labels is not divisible by "
                                 f"{axis}={size}, over which the logits are split")
            labels = labels.chunk(size, dim=1)[coord]
    return labels


def _vocab_parallel_cross_entropy(logits, labels, ignore_index, sub_mesh, axes, vocab_axis):
    """Per-token CE where each rank of ``vocab_axis`` holds a contiguous slice of the vocab."""
    local_vocab = logits.shape[-1]
    start = sub_mesh.get_local_rank(vocab_axis) * local_vocab
    with torch.no_grad():
        shift = logits.max(dim=-1, keepdim=True).values
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=sub_mesh.get_group(vocab_axis))
    shifted = logits - shift
    sum_exp = _sum_over(shifted.exp().sum(dim=-1), sub_mesh, axes, (vocab_axis,), nominal_seq=True)
    owned = (labels >= start) & (labels < start + local_vocab) & (labels != ignore_index)
    index = torch.where(owned, labels - start, 0).unsqueeze(-1)
    target = torch.where(owned, shifted.gather(-1, index).squeeze(-1), 0.0)
    target = _sum_over(target, sub_mesh, axes, (vocab_axis,), nominal_seq=True)
    return torch.log(sum_exp) - target


def _sum_over(tensor, sub_mesh, axes, sum_axes, nominal_seq: bool = False):
    """Differentiable sum over ``sum_axes``: each rank then holds the total, and each
    rank's input gets the total's gradient (DTensor's partial -> replicate)."""
    if not sum_axes:
        return tensor
    # Axes not summed over: the tensor is this rank's own piece there (sequence) or the same on all.
    keep = Shard(1) if nominal_seq and tensor.dim() > 1 else Replicate()
    source = tuple(Partial() if axis in sum_axes else keep for axis in axes)
    target = tuple(Replicate() if axis in sum_axes else keep for axis in axes)
    value = DTensor.from_local(tensor, sub_mesh, source, run_check=False)
    return value.redistribute(sub_mesh, target).to_local()
