"""Load safetensors weights into a parallelized model, each rank reading only its shards.

The model is planned and parallelized on the meta device first (``apply_sharding_plan``),
then materialized with ``model.to_empty(device=...)``; every DTensor parameter's local
piece is read straight from the checkpoint with ``safe_open(...).get_slice`` — a rank
never holds a full tensor that it only keeps a slice of.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

Segments = list[tuple[int, int]]  # half-open index ranges along one dimension


class ShardedLoadError(ValueError):
    """A checkpoint that does not fit the model; names the file and the tensor."""


@dataclass
class ShardedLoadReport:
    tensors: int = 0
    bytes_read: int = 0
    missing: list[str] = field(default_factory=list)


def checkpoint_index(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name → safetensors file, for a single file or a sharded ``*.index.json``."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ShardedLoadError(f"{model_dir}: no *.safetensors files")
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            out.update((name, file) for name in handle.keys())
    return out


def local_segments(global_shape, placements, coords, mesh_sizes) -> list[Segments]:
    """Per dimension, the index ranges of the global tensor this rank holds."""
    segments: list[Segments] = [[(0, size)] for size in global_shape]
    for placement, coord, size in zip(placements, coords, mesh_sizes):
        if isinstance(placement, _StridedShard):
            dim = placement.dim % len(global_shape)
            (start, stop), = segments[dim]
            block = (stop - start) // placement.split_factor
            segments[dim] = [_chunk_range(start + k * block, start + (k + 1) * block, size, coord)
                             for k in range(placement.split_factor)]
        elif isinstance(placement, Shard):
            dim = placement.dim % len(global_shape)
            (start, stop), = segments[dim]
            segments[dim] = [_chunk_range(start, stop, size, coord)]
    return segments


def _chunk_range(start: int, stop: int, pieces: int, index: int) -> tuple[int, int]:
    """The range ``torch.chunk`` gives piece ``index`` of ``pieces``."""
    length = stop - start
    step = -(-length // pieces)
    lo = min(start + index * step, stop)
    return lo, min(lo + step, stop)


def read_segments(handle_slice, segments: list[Segments], dim: int = 0, prefix: tuple = ()) -> torch.Tensor:
    if dim == len(segments):
        return handle_slice[prefix]
    parts = [read_segments(handle_slice, segments, dim + 1, prefix + (slice(lo, hi),)) for lo, hi in segments[dim]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


class StoredTensor:
    """One checkpoint tensor, read lazily by index ranges."""

    def __init__(self, handle, name: str):
        self.piece = handle.get_slice(name)
        self.shape = tuple(self.piece.get_shape())

    def read(self, segments: list[Segments]) -> torch.Tensor:
        return read_segments(self.piece, segments)


class StackedExperts:
    """A fused experts tensor (``gate_up_proj`` [E, 2I, H] or ``down_proj`` [E, H, I])
    assembled from per-expert checkpoint tensors (``experts.{e}.gate_proj.weight`` ...),
    reading only the rows and columns a rank keeps."""

    def __init__(self, blocks: list[list[StoredTensor]]):
        self.blocks = blocks  # per expert: the tensors concatenated along dim 0 of the fused block
        rows = sum(t.shape[0] for t in blocks[0])
        self.shape = (len(blocks), rows, blocks[0][0].shape[1])

    def read(self, segments: list[Segments]) -> torch.Tensor:
        experts = [e for lo, hi in segments[0] for e in range(lo, hi)]
        return torch.stack([self._expert_rows(self.blocks[e], segments[1], segments[2]) for e in experts])

    @staticmethod
    def _expert_rows(parts: list[StoredTensor], rows: Segments, cols: Segments) -> torch.Tensor:
        pieces, offset = [], 0
        for part in parts:
            size = part.shape[0]
            for lo, hi in rows:
                lo_in, hi_in = max(lo, offset) - offset, min(hi, offset + size) - offset
                if lo_in < hi_in:
                    pieces.append(part.read([[(lo_in, hi_in)], cols]))
            offset += size
        return torch.cat(pieces, dim=0)


_PER_EXPERT = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def tensor_source(name: str, where: dict[str, Path], handle_for) -> StoredTensor | StackedExperts | None:
    """Where ``name`` comes from: the tensor itself, or per-expert tensors to stack."""
    if name in where:
        return StoredTensor(handle_for(where[name]), name)
    prefix, _, leaf = name.rpartition(".")
    if leaf not in _PER_EXPERT:
        return None
    blocks = []
    while True:
        keys = [f"{prefix}.{len(blocks)}.{proj}.weight" for proj in _PER_EXPERT[leaf]]
        if not all(key in where for key in keys):
            break
        blocks.append([StoredTensor(handle_for(where[key]), key) for key in keys])
    return StackedExperts(blocks) if blocks else None


@torch.no_grad()
def load_sharded_safetensors(model: torch.nn.Module, model_dir: str | Path, *, strict: bool = True) -> ShardedLoadReport:
    """Fill every parameter and persistent buffer of a materialized model from ``model_dir``."""
    where = checkpoint_index(model_dir)
    report = ShardedLoadReport()
    handles: dict[Path, object] = {}

    def handle_for(file: Path):
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        return handles[file]

    loaded: set[int] = set()
    try:
        for name, tensor in [*model.named_parameters(remove_duplicate=False), *_persistent_buffers(model)]:
            source = tensor_source(name, where, handle_for)
            if source is None:
                if id(tensor) not in loaded:  # a tied weight stored once is fine
                    report.missing.append(name)
                continue
            _copy_local(name, tensor, source, Path(model_dir))
            loaded.add(id(tensor))
            report.tensors += 1
            report.bytes_read += tensor.to_local().nbytes if isinstance(tensor, DTensor) else tensor.nbytes
    finally:
        handles.clear()
    report.missing = [name for name in report.missing if id(_lookup(model, name)) not in loaded]
    if strict and report.missing:
        raise ShardedLoadError(f"{model_dir}: no checkpoint tensor for {', '.join(report.missing[:5])}")
    return report


def _lookup(model: torch.nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, leaf)


def _persistent_buffers(model: torch.nn.Module):
    """Buffers a checkpoint holds (non-persistent ones, like rotary caches, are recomputed)."""
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buf


def _copy_local(name: str, tensor: torch.Tensor, source, model_dir: Path) -> None:
    if tuple(source.shape) != tuple(tensor.shape):
        raise ShardedLoadError(f"{model_dir}: {name}: checkpoint shape {tuple(source.shape)}, "
                               f"model expects {tuple(tensor.shape)}")
    full = [[(0, size)] for size in source.shape]
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        segments = local_segments(source.shape, tensor.placements, mesh.get_coordinate(), tuple(mesh.shape))
        local = tensor.to_local()
        local.copy_(source.read(segments).to(local.dtype))
    else:
        tensor.copy_(source.read(full).to(tensor.dtype))


def materialize_and_load(model: torch.nn.Module, model_dir: str | Path, *, device: str | torch.device = "cpu",
                         strict: bool = True) -> ShardedLoadReport:
    """Allocate a meta-device (already parallelized) model's local shards on ``device``
    and fill them from the checkpoint. Buffers that were built for real (e.g. rotary
    ``inv_freq`` under ``accelerate.init_empty_weights(include_buffers=False)``) keep
    their values; ``to_empty`` would otherwise leave them uninitialized."""
    from hyper_parallel.distributed.applier import reinstall_grad_hooks

    kept = {name: buf.detach().clone() for name, buf in model.named_buffers() if not buf.is_meta}
    model.to_empty(device=device)
    reinstall_grad_hooks(model)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in kept:
                buf.copy_(kept[name])
    return load_sharded_safetensors(model, model_dir, strict=strict)
