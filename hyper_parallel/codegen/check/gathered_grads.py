"""Every parameter's whole gradient on verify's rank 0, gathered from the ranks' local pieces.

Verify compares each whole gradient with the one-process reference's. Each rank sends the
elements it holds of a parameter (``_local_piece``: a DTensor's local shard with its
elements' flat positions in the whole, ``local_elements``), rank 0 alone receives them
(``_gather_pieces``: no rank holds a whole gradient it does not need), puts them in place
and measures how far the replicas of each element spread (a replicated gradient whose
copies disagree is a missing reduction).
"""

import functools
import itertools
import math
from typing import Any

from hyper_parallel.errors import HyperParallelError


def gathered_grads(model, whole: dict[str, tuple], *, pipelined: bool) -> tuple[dict, dict]:
    """Every parameter's whole gradient (``_gather``) and its replicas' spread, by the whole
    model's names (``whole``: name -> (shape, dtype)): under pp each rank holds only its
    stages' parameters and gives nothing for the others, but every rank takes part in every
    gather, in one order."""
    import torch.distributed as dist

    from hyper_parallel.distributed.local_views import packed_rows

    held = dict(model.named_parameters())
    packed = packed_rows(model)
    with_grad = {name for name, param in held.items() if param.grad is not None}
    if pipelined:  # which names have a gradient somewhere
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, sorted(with_grad))
        with_grad = set().union(*map(set, found))
    names = [name for name in whole if name in with_grad]
    pieces = []
    for name in names:
        param = held.get(name)
        try:
            pieces.append(_local_piece(None if param is None else param.grad, *whole[name], packed.get(name)))
        except RuntimeError as exc:
            raise RuntimeError(f"gathering the gradient of {name}: {exc}") from exc
    try:
        gathered = _gather_pieces(pieces, [whole[name] for name in names])
    except _NotHeld as exc:
        raise RuntimeError(f"gathering the gradient of {names[exc.position]}: {exc}") from None
    grads = {name: None for name in whole}
    grads.update((name, result[0]) for name, result in zip(names, gathered))
    return grads, {name: result[1] for name, result in zip(names, gathered)}


def _gather(tensor, shape: tuple[int, ...], dtype, rows=None) -> tuple[Any, float]:
    """One tensor's ``_gather_pieces``: its whole on rank 0 (None on the others) and the
    spread of its replicas."""
    return _gather_pieces([_local_piece(tensor, shape, dtype, rows)], [(shape, dtype)])[0]


class _NotHeld(RuntimeError, HyperParallelError):
    """No rank holds some elements of the tensor at ``position`` of a gather."""

    def __init__(self, position: int):
        super().__init__("no rank holds some elements of the tensor")
        self.position = position


def _local_piece(tensor, shape: tuple[int, ...], dtype, rows=None) -> tuple[Any, Any]:
    """This rank's piece of a tensor of ``shape``: (element numbers, values), flat. Where
    each piece sits: ``local_elements`` on an index grid; a plain tensor is one piece every
    rank holds; None: a rank that holds none of it (another pipeline stage's parameter).
    (DTensor's ``full_tensor`` cannot undo FSDP2's strided shard over edp on expert weights
    that are sharded over ep as well, nor a packed parameter's order: ``rows``, its
    ``local_views.PackedRows``.) A DTensor with a sum pending is reduced here, a
    collective of its mesh's ranks."""
    import torch
    from torch.distributed.tensor import DTensor, Partial

    numel = math.prod(shape)
    # element numbers as int32 where they fit: every thread rank holds one such grid at once
    index = torch.arange(numel, dtype=_index_dtype(numel)).reshape(shape)
    if tensor is None:
        return index.reshape(-1)[:0].clone(), torch.zeros(0, dtype=dtype)
    if isinstance(tensor, DTensor):
        if any(isinstance(p, Partial) for p in tensor.placements):
            local = tensor.full_tensor()  # a sum still pending: DTensor reduces it
        else:
            mesh = tensor.device_mesh
            if rows is not None:  # the stored tensor's elements, in packed order
                index = index.index_select(rows.dim, rows.stored_rows())
            index = local_elements(index, tensor.placements, [mesh.size(dim) for dim in range(mesh.ndim)],
                                   mesh.get_coordinate())
            local = tensor.to_local()
    else:
        local = tensor
    if local.numel() != index.numel():
        raise RuntimeError(f"this rank's piece has {local.numel()} elements where its placements give "
                           f"{index.numel()} of the whole {tuple(shape)}")
    return index.reshape(-1).clone(), local.detach().reshape(-1)  # (the whole grid freed)


def _index_dtype(numel: int):
    import torch

    return torch.int32 if numel < 2**31 else torch.int64


def _gather_pieces(pieces: list[tuple[Any, Any]], wholes: list[tuple[tuple[int, ...], Any]]) -> list[tuple[Any, float]]:
    """Per tensor (``pieces[i]``: this rank's, ``wholes[i]``: its (shape, dtype)): the
    whole tensor on rank 0 (None on the others), rebuilt from every rank's piece, and how
    far the ranks' copies of the same element disagree: replicas that differ would train
    different weights, so averaging them must not hide it.

    Only rank 0 compares: the pieces are gathered to it, so no other rank holds a
    whole-sized buffer (at 256 thread ranks, every rank's whole-sized sum and count were
    most of verify's memory). All tensors travel in one exchange, four collectives in all:
    at 256 thread ranks each collective costs about a second of waking threads, and one
    exchange per tensor was most of verify's time. An element no rank holds makes every
    rank raise (``_NotHeld``), not rank 0 alone."""
    import torch
    import torch.distributed as dist

    if not pieces:  # (every rank has the same list of tensors)
        return []
    on_rank0 = _pieces_on_rank0(pieces)
    failed = torch.zeros(1, dtype=torch.int64)  # 1 + the position of the first tensor not whole
    results: list[tuple[Any, float]] = [(None, 0.0)] * len(pieces)
    if on_rank0 is not None:
        for position, ((shape, _), ranks_pieces) in enumerate(zip(wholes, on_rank0)):
            # in the dtype of rank 0's own piece, as the pieces come back
            whole, spread = _whole_from_pieces(ranks_pieces, math.prod(shape), pieces[position][1].dtype)
            if whole is None:
                failed[0] = position + 1
                break
            results[position] = (whole.reshape(shape), spread)
    dist.broadcast(failed, src=0)  # every rank raises alike
    if failed.item():
        raise _NotHeld(int(failed.item()) - 1)
    return results


def _pieces_on_rank0(pieces: list[tuple[Any, Any]]) -> list[list[tuple[Any, Any]]] | None:
    """Per tensor, every rank's (element numbers, values) on rank 0; None on the others.
    One gather of all element numbers and one of all values (in a type every tensor's
    values convert to and back exactly), each padded to the longest rank's pieces (they
    differ: uneven shards, ranks holding none)."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    counts = torch.tensor([index.numel() for index, _ in pieces], dtype=torch.int64)
    every = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(every, counts)
    table = torch.stack(every).tolist()  # [rank][tensor]: piece lengths
    longest = max(sum(row) for row in table)
    index_dtype = functools.reduce(torch.promote_types, (index.dtype for index, _ in pieces), torch.int32)
    value_dtype = functools.reduce(torch.promote_types, (values.dtype for _, values in pieces))
    mine = sum(table[rank])
    flat_index, flat_values = torch.zeros(longest, dtype=index_dtype), torch.zeros(longest, dtype=value_dtype)
    if mine:
        torch.cat([index.to(index_dtype) for index, _ in pieces], out=flat_index[:mine])
        torch.cat([values.to(value_dtype) for _, values in pieces], out=flat_values[:mine])
    gathered = []
    for flat in (flat_index, flat_values):
        into = [torch.empty_like(flat) for _ in range(world)] if rank == 0 else None
        dist.gather(flat, into, dst=0)
        gathered.append(into)
    if rank != 0:
        return None
    out: list[list[tuple[Any, Any]]] = [[] for _ in pieces]
    for row, indices, values in zip(table, *gathered):
        for position, (length, start) in enumerate(zip(row, itertools.accumulate(row, initial=0))):
            # views, not copies (index_add_ and indexing take int32 element numbers as they are)
            piece = slice(start, start + length)
            out[position].append((indices[piece], values[piece].to(pieces[position][1].dtype)))
    return out


def _whole_from_pieces(pieces, numel: int, dtype) -> tuple[Any, float]:
    """(whole tensor, 2 x the largest distance of a copy from it) from every rank's piece:
    each element the mean of its copies; None for the whole when some element has none."""
    import torch

    values, count = torch.zeros(numel, dtype=dtype), torch.zeros(numel, dtype=dtype)
    for indices, piece in pieces:
        values.index_add_(0, indices, piece)
        count.index_add_(0, indices, torch.ones_like(piece))
    if bool((count == 0).any()):
        return None, 0.0
    whole = values / count
    spread = max(((piece - whole[indices]).abs().max().item() for indices, piece in pieces if piece.numel()),
                 default=0.0)
    return whole, 2 * spread


def local_elements(index, placements, sizes: list[int], coords: list[int]):
    """The elements of ``index`` (the whole tensor's element numbers) one rank holds under
    ``placements``: ``local_piece`` mesh dim by mesh dim, outermost first, as DTensor lays
    them out, except for FSDP2's split of what the plan already split. FSDP2 shards the
    piece a rank holds along the plan's dim and records that as a ``_StridedShard`` whose
    split factor counts the later mesh dims' pieces, which describes the piece only where
    the plan's split is a plain shard; after a packed split ([gate | up] kept per rank as
    a ``_StridedShard`` itself) the rank holds a plain shard of its packed piece, so that
    mesh dim is applied last, as a plain shard."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from hyper_parallel.distributed.applier import local_piece

    order, last = [], []
    for dim, placement in enumerate(placements):
        later = [d for d in range(dim + 1, len(placements))
                 if isinstance(placements[d], (Shard, _StridedShard)) and placements[d].dim == getattr(placement, "dim", None)]
        if (isinstance(placement, _StridedShard) and any(isinstance(placements[d], _StridedShard) for d in later)
                and placement.split_factor == math.prod(sizes[d] for d in later)):
            last.append(dim)
        else:
            order.append(dim)
    for dim in order + last:
        placement = Shard(placements[dim].dim) if dim in last else placements[dim]
        index = local_piece(index, placement, sizes[dim], coords[dim])
    return index
