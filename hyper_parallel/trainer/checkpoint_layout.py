"""Resume at another layout: the load view of a checkpoint saved at a different
parallel layout (tp2 → dp2 with FSDP2, tp2+cp2+ep2 at world 4 → tp2 at world 2, any
layout → one process).

DCP reshards a plainly sharded tensor by itself: each rank asks for the chunk its
placements give it. A packed tensor split over tp (``_StridedShard``, a fused gate_up
projection; or blocks of unequal sizes stored in packed order, ``local_views.PackedRows``)
is saved as its blocks, ``<key>@part<k>of<s>`` (``checkpoint._split_strided``,
``_split_packed``), and a layout without that placement saves the tensor whole under
``<key>``. So a resume at another layout may find the other form. The view is adapted
to the form the checkpoint holds (read from its DCP metadata), and after the load the
values are copied into the model's tensors:

- saved as blocks, loaded unpacked: one holder per block, the rank's part of the
  block's rows (the blocks' sizes from the saved shapes); where this layout splits that
  dimension (FSDP2's rows over dp) the holder has the whole block and each rank copies
  the rows it holds;
- saved whole, loaded as blocks: one holder of the whole packed dimension (the split
  mesh axis replicated), from which each block's chunk is copied.
"""

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.distributed.sharded_load import chunk_range
from hyper_parallel.errors import HyperParallelError

_LOG = logging.getLogger(__name__)

_PART = re.compile(r"^(?P<key>.+)@part(?P<k>\d+)of(?P<s>\d+)$")


class CheckpointLayoutError(ValueError, HyperParallelError):
    """A checkpoint tensor whose saved form this layout cannot load; names it."""


def saved_tensors(path: str | Path) -> dict[str, torch.Size]:
    """The tensors a DCP checkpoint holds (flattened keys) and their global shapes."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return {key: md.size for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


@dataclass
class Restore:
    """Copies one loaded holder's values into the model's tensor after ``dcp.load``."""

    run: Callable[[], None]


def adapt_view(view: dict, parts: list, saved: dict[str, torch.Size]) -> tuple[dict, list[Restore]]:
    """``view`` (``checkpoint._dcp_view``'s, for this layout) changed where the checkpoint
    holds a packed tensor in the other form; ``parts``: that view's strided blocks, from
    which the blocks a whole-tensor holder replaces are removed (their copy-back is the
    holder's). The restores copy the holders back after the load."""
    restores: list[Restore] = []
    dropped: set[int] = set()
    adapted = _walk(view, "", saved, {id(part.saved): part for part in parts}, restores, dropped)
    parts[:] = [part for part in parts if id(part.saved) not in dropped]
    return adapted, restores


def _walk(view: dict, prefix: str, saved: dict[str, torch.Size], by_saved: dict, restores: list,
          dropped: set[int]) -> dict:
    """One dict level of the view, adapted entry by entry (flattened keys as DCP's)."""
    out: dict = {}
    for name, value in view.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            out[name] = _walk(value, f"{key}.", saved, by_saved, restores, dropped)
            continue
        found = _PART.match(name)
        if found and key not in saved and f"{prefix}{found['key']}" in saved and id(value) in by_saved:
            if found["key"] not in out:  # one holder for all the blocks of this tensor
                blocks = [v for n, v in view.items() if (m := _PART.match(n)) and m["key"] == found["key"]]
                out[found["key"]], restore = _whole_holder(by_saved, blocks)
                restores.append(restore)
            dropped.add(id(value))
            continue
        if isinstance(value, torch.Tensor) and key not in saved and any(k.startswith(f"{key}@part") for k in saved):
            out.update(_block_holders(name, key, value, saved, restores))
            continue
        out[name] = value
    return out


def _block_holders(name: str, key: str, tensor: torch.Tensor, saved: dict[str, torch.Size],
                   restores: list) -> dict[str, torch.Tensor]:
    """Saved as ``s`` blocks along one dimension, loaded here unpacked: a holder per block."""
    blocks = sorted((int(m["k"]), int(m["s"]), k) for k in saved if (m := _PART.match(k)) and m["key"] == key)
    count = blocks[0][1]
    shapes = [saved[k] for _, _, k in blocks]
    dims = {d for shape in shapes for d, (a, b) in enumerate(zip(shape, tensor.shape)) if a != b}
    dim = next(iter(dims), None)
    if len(blocks) != count or len(dims) != 1 or any(len(s) != tensor.dim() for s in shapes) \
            or sum(s[dim] for s in shapes) != tensor.shape[dim]:
        raise CheckpointLayoutError(
            f"{key}: saved as {len(blocks)} block(s) of shapes {[tuple(s) for s in shapes]}, which "
            f"do not make this layout's {tuple(tensor.shape)}")
    out, start = {}, 0
    for k, shape in enumerate(shapes):  # equal blocks (a strided split) or unequal (packed order)
        holder, copy_back = _block(tensor, dim, start, shape[dim], key)
        out[f"{name}@part{k}of{count}"] = holder
        restores.append(Restore(copy_back))
        start += shape[dim]
    return out


def _block(tensor: torch.Tensor, dim: int, start: int, length: int, key: str):
    """A holder for ``tensor.narrow(dim, start, length)`` and its copy-back; the packed
    dimension must be whole on every rank (no placement splits it)."""
    if not isinstance(tensor, DTensor):
        holder = tensor.detach().narrow(dim, start, length).clone()
        return holder, lambda: tensor.detach().narrow(dim, start, length).copy_(holder)
    if any(isinstance(p, Shard) and p.dim % tensor.dim() == dim for p in tensor.placements):
        return _block_of_split_dim(tensor, dim, start, length, key)
    local = tensor.to_local()
    block = local.detach().narrow(dim, start, length).clone()
    shape = list(tensor.shape)
    shape[dim] = length
    holder = DTensor.from_local(block, tensor.device_mesh, tensor.placements, run_check=False,
                                shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())

    def copy_back():
        """The loaded block into the rank's local tensor."""
        local.detach().narrow(dim, start, length).copy_(holder.to_local())

    return holder, copy_back


def _block_of_split_dim(tensor: DTensor, dim: int, start: int, length: int, key: str):
    """A holder for a block along a dim this layout shards over one mesh dim (FSDP2's rows
    over dp, of a tensor a tp layout saved as blocks): the whole block on every rank of
    that mesh dim, and the copy of the rows this rank holds."""
    split = [i for i, p in enumerate(tensor.placements) if isinstance(p, Shard) and p.dim % tensor.dim() == dim]
    if len(split) != 1 or isinstance(tensor.placements[split[0]], _StridedShard):
        raise CheckpointLayoutError(f"{key}: saved as blocks along dim {dim}, which this layout shards "
                                    f"({tuple(tensor.placements)}); resuming into that is not supported yet")
    mesh, axis = tensor.device_mesh, split[0]
    lo, hi = chunk_range(0, tensor.shape[dim], mesh.size(axis), mesh.get_coordinate()[axis])
    local = tensor.to_local()
    placements = list(tensor.placements)
    placements[axis] = Replicate()
    buffer_shape = list(local.shape)
    buffer_shape[dim] = length
    buffer = local.new_empty(buffer_shape)
    shape = list(tensor.shape)
    shape[dim] = length
    holder = DTensor.from_local(buffer, mesh, placements, run_check=False, shape=torch.Size(shape),
                                stride=torch.empty(shape, device="meta").stride())

    def copy_back():
        """The block's rows that fall in this rank's rows."""
        first, last = max(lo, start), min(hi, start + length)
        if first < last:
            local.detach().narrow(dim, first - lo, last - first).copy_(buffer.narrow(dim, first - start, last - first))

    return holder, copy_back


def _whole_holder(by_saved: dict, blocks: list[DTensor]) -> tuple[DTensor, Restore]:
    """Saved whole, loaded strided: a holder whose strided mesh axis is replicated (so it
    holds the whole packed dimension), and the copy of each block's chunk from it."""
    first = by_saved[id(blocks[0])]
    dim = first.dim
    mesh, placements = first.saved.device_mesh, list(first.saved.placements)
    axis = next(i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim)
    placements[axis] = Replicate()
    starts, total = [], 0  # each block's offset in the whole (blocks of unequal sizes: packed order)
    for block in blocks:
        starts.append(total)
        total += by_saved[id(block)].saved.shape[dim]
    shape = list(first.saved.shape)
    shape[dim] = total
    local_shape = list(first.local.shape)
    local_shape[dim] = shape[dim]
    buffer = first.local.new_empty(local_shape)
    holder = DTensor.from_local(buffer, mesh, placements, run_check=False, shape=torch.Size(shape),
                                stride=torch.empty(shape, device="meta").stride())
    coordinate = mesh.get_coordinate()[axis]

    def copy_back():
        """Each block's chunk for this rank, out of the whole packed dimension loaded."""
        for start, block in zip(starts, blocks):
            part = by_saved[id(block)]
            chunk = buffer.narrow(dim, start + coordinate * part.length, part.length)
            part.local.narrow(dim, part.start, part.length).copy_(chunk)

    return holder, Restore(copy_back)
