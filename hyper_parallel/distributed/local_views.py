"""One rank's share of a tensor or a module, by the rules the plan writes.

Shared by the applier (which gives a planned module its local shards while it runs) and
the dataflow's dry run (which runs the model's own code on one rank's share before a
block is planned split), so that what is measured is what runs.

- ``local_piece``: the piece a placement gives one mesh dim's rank (``Shard``: a
  contiguous chunk; ``_StridedShard``: that chunk of each of its equal blocks).
- ``packed_blocks_piece``: the piece of a tensor packing blocks of *unequal* sizes along
  one dim (Qwen3-Next's depthwise convolution over ``[q | k | v]`` channels, ``key_dim``,
  ``key_dim`` and ``value_dim`` wide): that chunk of each block (``ShardingConfig.local_slices``).
  No DTensor placement says this layout, so such a parameter is either stored ``Shard(dim)``
  over tp with its rows in *packed order* (``PackedRows``: each rank's piece of every
  block contiguous, rank after rank), or, where FSDP2 shards the rows further over dp,
  stored replicated, each rank using its piece (its gradient a partial sum over tp).
- ``local_sizes``: the integer attributes a module's own code reshapes by (head counts,
  widths) at one rank's share (``ShardingConfig.local_sizes``).
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.errors import HyperParallelError


class LocalViewError(ValueError, HyperParallelError):
    """A module's sizes or packed blocks that do not split evenly over the axis."""


def local_piece(tensor: torch.Tensor, placement, pieces: int, index: int) -> torch.Tensor:
    """The piece ``index`` of ``pieces`` that ``placement`` gives one mesh dim's rank. Applied
    mesh dim by mesh dim, outermost first, this is the layout DTensor and FSDP2 use
    (a ``_StridedShard`` is split inside the blocks of the shard applied after it)."""
    if isinstance(placement, _StridedShard):
        blocks = tensor.chunk(placement.split_factor, dim=placement.dim)
        return torch.cat([_chunk(block, placement.dim, pieces, index) for block in blocks], dim=placement.dim)
    if isinstance(placement, Shard):
        return _chunk(tensor, placement.dim, pieces, index)
    if isinstance(placement, Partial):
        raise LocalViewError("a parameter is stored Replicate where it is placed Partial")
    return tensor


def _chunk(tensor: torch.Tensor, dim: int, pieces: int, index: int) -> torch.Tensor:
    chunks = tensor.chunk(pieces, dim=dim)
    if index < len(chunks):
        return chunks[index]
    return tensor.narrow(dim, 0, 0)  # torch.chunk gave fewer pieces: this rank's shard is empty


def block_sizes(module: nn.Module, names: tuple[str, ...], where: str) -> list[int]:
    """The full sizes of packed blocks named by the module's own integer attributes, one
    (``key_dim``) or a product of them (``n_groups*ssm_state_size``)."""
    sizes = []
    for name in names:
        size = 1
        for part in name.split("*"):
            value = getattr(module, part, None)
            if not isinstance(value, int) or isinstance(value, bool):
                raise LocalViewError(f"{where}: packed block size {part!r} is not an integer attribute of "
                                     f"{type(module).__name__} (got {value!r})")
            size *= value
        sizes.append(size)
    return sizes


def packed_blocks_piece(tensor: torch.Tensor, dim: int, sizes: list[int], pieces: int, index: int,
                        where: str) -> torch.Tensor:
    """Rank ``index``'s piece of ``tensor`` packing blocks of ``sizes`` along ``dim``: the
    ``index``-th of ``pieces`` equal chunks of every block, concatenated in block order."""
    if sum(sizes) != tensor.shape[dim]:
        raise LocalViewError(f"{where}: packed blocks {sizes} sum to {sum(sizes)}, but dim {dim} is "
                             f"{tensor.shape[dim]} wide")
    uneven = [size for size in sizes if size % pieces]
    if uneven:
        raise LocalViewError(f"{where}: packed blocks {sizes} do not divide into {pieces} equal pieces")
    segments = PackedRows(dim, tuple(sizes), pieces, mesh_dim=0).segments(index)
    return torch.cat([tensor.narrow(dim, lo, hi - lo) for lo, hi in segments], dim=dim)


def local_sizes(module: nn.Module, names: tuple[str, ...], pieces: int, where: str) -> dict[str, int]:
    """The module's size attributes ``names`` at one rank's share of ``pieces``."""
    shares = {}
    for name in names:
        value = getattr(module, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value % pieces:
            raise LocalViewError(f"{where}: {type(module).__name__}.{name} = {value!r} does not divide into "
                                 f"{pieces} equal shares (tp_size={pieces}); choose a tp_size that divides it")
        shares[name] = value // pieces
    return shares


def owner_of(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding parameter ``name`` (relative to ``module``, dotted for a child's:
    ``conv1d.weight``) and the parameter's own name there."""
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


PACKED_ROWS_ATTRIBUTE = "hyper_packed_rows"  # on the model: parameter name -> PackedRows


@dataclass(frozen=True)
class PackedRows:
    """How a parameter packing blocks of unequal ``sizes`` along ``dim`` is stored
    ``Shard(dim)`` over ``pieces`` tp ranks: its global tensor holds rank 0's piece of
    every block (block order), then rank 1's, and so on; a rank's local tensor is then
    exactly ``packed_blocks_piece`` of the model's tensor. The one place that order is
    defined: loading, the dry run, verify's gather, the checkpoint (which saves each
    block as a tensor of its own, so a checkpoint does not depend on the tp size) and
    export read it from here. ``mesh_dim``: the tp dim of the parameter's mesh."""

    dim: int
    sizes: tuple[int, ...]
    pieces: int
    mesh_dim: int

    def segments(self, index: int) -> list[tuple[int, int]]:
        """The model tensor's row ranges (along ``dim``) rank ``index`` holds, block by block."""
        out, start = [], 0
        for size in self.sizes:
            step = size // self.pieces
            out.append((start + index * step, start + (index + 1) * step))
            start += size
        return out

    def stored_rows(self) -> torch.Tensor:
        """Row ``i`` of the stored (global) tensor is row ``stored_rows()[i]`` of the model's."""
        return torch.cat([torch.arange(lo, hi) for index in range(self.pieces)
                          for lo, hi in self.segments(index)])

    def local_blocks(self) -> list[tuple[int, int]]:
        """(start, length) of each block's rows within one rank's local tensor."""
        out, start = [], 0
        for size in self.sizes:
            out.append((start, size // self.pieces))
            start += size // self.pieces
        return out


def packed_rows(model: nn.Module) -> dict[str, "PackedRows"]:
    """The model's parameters stored in packed order, by name (empty for most models)."""
    return model.__dict__.get(PACKED_ROWS_ATTRIBUTE, {})
