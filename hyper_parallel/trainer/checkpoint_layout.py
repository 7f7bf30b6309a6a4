"""Resume at another layout: the load view of a checkpoint saved at a different
parallel layout (tp2 → dp2 with FSDP2, tp2+cp2+ep2 at world 4 → tp2 at world 2, any
layout → one process).

DCP reshards a plainly sharded tensor by itself: each rank asks for the chunk its
placements give it. A packed tensor split over tp (``_StridedShard``, a fused gate_up
projection) is saved as its blocks, ``<key>@part<k>of<s>`` (``checkpoint._split_strided``),
and a layout without that placement saves the tensor whole under ``<key>``. So a
resume at another layout may find the other form. The view is adapted to the form the
checkpoint holds (read from its DCP metadata), and after the load the values are
copied into the model's tensors:

- saved as blocks, loaded unpacked: one holder per block, the rank's part of
  ``tensor.narrow(dim, k * L, L)`` (the packed dimension is not split in this layout);
- saved whole, loaded strided: one holder of the whole packed dimension (the strided
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

from hyper_parallel.errors import HyperParallelError

_LOG = logging.getLogger(__name__)

_PART = re.compile(r"^(?P<key>.+)@part(?P<k>\d+)of(?P<s>\d+)$")


class LayoutError(ValueError, HyperParallelError):
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
    shape = saved[blocks[0][2]]
    dims = [d for d, (a, b) in enumerate(zip(shape, tensor.shape)) if a != b]
    if len(blocks) != count or len(dims) != 1 or shape[dims[0]] * count != tensor.shape[dims[0]]:
        raise LayoutError(f"{key}: saved as {len(blocks)} block(s) of shape {tuple(shape)}, which do not make "
                          f"this layout's {tuple(tensor.shape)}")
    dim, length = dims[0], shape[dims[0]]
    out = {}
    for k in range(count):
        holder, copy_back = _block(tensor, dim, k * length, length, key)
        out[f"{name}@part{k}of{count}"] = holder
        restores.append(Restore(copy_back))
    return out


def _block(tensor: torch.Tensor, dim: int, start: int, length: int, key: str):
    """A holder for ``tensor.narrow(dim, start, length)`` and its copy-back; the packed
    dimension must be whole on every rank (no placement splits it)."""
    if not isinstance(tensor, DTensor):
        holder = tensor.detach().narrow(dim, start, length).clone()
        return holder, lambda: tensor.detach().narrow(dim, start, length).copy_(holder)
    if any(isinstance(p, Shard) and p.dim % tensor.dim() == dim for p in tensor.placements):
        raise LayoutError(f"{key}: saved as blocks along dim {dim}, which this layout shards "
                          f"({tuple(tensor.placements)}); resuming into that is not supported yet")
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


def _whole_holder(by_saved: dict, blocks: list[DTensor]) -> tuple[DTensor, Restore]:
    """Saved whole, loaded strided: a holder whose strided mesh axis is replicated (so it
    holds the whole packed dimension), and the copy of each block's chunk from it."""
    first = by_saved[id(blocks[0])]
    dim, count = first.dim, len(blocks)
    mesh, placements = first.saved.device_mesh, list(first.saved.placements)
    axis = next(i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim)
    placements[axis] = Replicate()
    block_global = first.saved.shape[dim]
    shape = list(first.saved.shape)
    shape[dim] = block_global * count
    local_shape = list(first.local.shape)
    local_shape[dim] = shape[dim]
    buffer = first.local.new_empty(local_shape)
    holder = DTensor.from_local(buffer, mesh, placements, run_check=False, shape=torch.Size(shape),
                                stride=torch.empty(shape, device="meta").stride())
    coordinate = mesh.get_coordinate()[axis]

    def copy_back():
        """Each block's chunk for this rank, out of the whole packed dimension loaded."""
        for k, block in enumerate(blocks):
            part = by_saved[id(block)]
            chunk = buffer.narrow(dim, k * block_global + coordinate * part.length, part.length)
            part.local.narrow(dim, part.start, part.length).copy_(chunk)

    return holder, Restore(copy_back)
