"""Load safetensors weights into a parallelized model, each rank reading only its shards.

The model is planned and parallelized on the meta device first (``apply_sharding_plan``),
then materialized with ``model.to_empty(device=...)``; every DTensor parameter's local
piece is read straight from the checkpoint with ``safe_open(...).get_slice`` — a rank
never holds a full tensor that it only keeps a slice of.

Which checkpoint tensors make which parameter is the weight map (``weight_map``): recorded
by codegen in the bundle's meta, or derived here the same way — transformers' own
renamings and conversions that ``from_pretrained`` applies (per-expert tensors stacked
into packed experts, gate and up concatenated, renamed blocks) traced on placeholders —
so that the slices are still read, not the whole tensors.
"""

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.distributed.checkpoint_names import (
    InMemory,
    LazyTensor,
    Segments,
    StoredTensor,
    model_tensor_names,
)
from hyper_parallel.distributed.local_views import PackedRows, packed_rows
from hyper_parallel.distributed.weight_map import RecordedMap, WeightMapError, derive_weight_map, to_text
from hyper_parallel.distributed.weight_map_sources import weight_map_sources
from hyper_parallel.errors import HyperParallelError

_LOG = logging.getLogger(__name__)


class ShardedLoadError(ValueError, HyperParallelError):
    """A checkpoint that does not fit the model; names the file and the tensor."""


@dataclass
class ShardedLoadReport:
    tensors: int = 0
    bytes_read: int = 0
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # converters read whole (not sliceable)


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


def local_segments(global_shape, placements, coords, mesh_sizes, rows: PackedRows | None = None) -> list[Segments]:
    """Per dimension, the index ranges of the global tensor this rank holds (of the
    model's tensor, for one stored in packed order: ``rows``)."""
    segments: list[Segments] = [[(0, size)] for size in global_shape]
    for mesh_dim, (placement, coord, size) in enumerate(zip(placements, coords, mesh_sizes)):
        if rows is not None and mesh_dim == rows.mesh_dim:
            segments[rows.dim] = rows.segments(coord)
        elif isinstance(placement, _StridedShard):
            dim = placement.dim % len(global_shape)
            (start, stop), = segments[dim]
            block = (stop - start) // placement.split_factor
            segments[dim] = [chunk_range(start + k * block, start + (k + 1) * block, size, coord)
                             for k in range(placement.split_factor)]
        elif isinstance(placement, Shard):
            dim = placement.dim % len(global_shape)
            (start, stop), = segments[dim]
            segments[dim] = [chunk_range(start, stop, size, coord)]
    return segments


def chunk_range(start: int, stop: int, pieces: int, index: int) -> tuple[int, int]:
    """The range ``torch.chunk`` gives piece ``index`` of ``pieces``."""
    length = stop - start
    step = -(-length // pieces)
    lo = min(start + index * step, stop)
    return lo, min(lo + step, stop)


def load_sharded_safetensors(model: torch.nn.Module, model_dir: str | Path, *, strict: bool = True,
                             key_mapping: dict[str, str] | None = None,
                             weight_map: dict[str, str | list[str]] | None = None,
                             source_model: torch.nn.Module | None = None) -> ShardedLoadReport:
    """Fill every parameter and persistent buffer of a materialized model from ``model_dir``.

    ``weight_map``: the recorded mapping (a bundle's ``codegen_meta.json``), checkpoint
    name → the parameter part it fills. Without one, or for tensors it leaves empty (a
    checkpoint in another layout), the same mapping is derived here from the checkpoint's
    own names by transformers' renamings and conversions (``key_mapping`` as
    ``from_pretrained`` takes it), through ``source_model`` first where the model is not
    the checkpoint's own class (the custom backend; see ``derive_weight_map``)."""
    where = checkpoint_index(model_dir)
    handles: dict[Path, object] = {}
    leaves: dict[str, StoredTensor] = {}

    def leaf(key: str) -> StoredTensor:
        """Checkpoint tensor ``key``, opened once (several boxes may read it)."""
        if key not in leaves:
            file = where[key]
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt")
            leaves[key] = StoredTensor(handles[file], key)
        return leaves[key]

    try:
        return _fill(model, str(model_dir), where, leaf, strict=strict, weight_map=weight_map,
                     key_mapping=key_mapping, source_model=source_model)
    finally:
        leaves.clear()
        handles.clear()


def load_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor], *, origin: str,
                 source_model: torch.nn.Module | None = None) -> ShardedLoadReport:
    """``load_sharded_safetensors`` for tensors already in memory (a ``pytorch_model.bin``
    folder, an HF model's state dict): the same derived weight map places them, so a
    checkpoint in any layout transformers converts fills the model. ``origin`` names
    where the tensors came from in errors."""
    leaves = {key: InMemory(tensor) for key, tensor in tensors.items()}
    return _fill(model, origin, leaves, leaves.__getitem__, strict=True, weight_map=None, key_mapping=None,
                 source_model=source_model)


@torch.no_grad()
def _fill(model, origin: str, where, leaf, *, strict, weight_map, key_mapping, source_model) -> ShardedLoadReport:
    """Copy each model tensor's (local part of its) source; the tensors nothing fills are
    an error under ``strict``."""
    report = ShardedLoadReport()
    loaded: set[int] = set()
    sources = _sources(model, origin, where, leaf, weight_map, key_mapping, source_model,
                       lambda line: _note(report, line))
    packed = packed_rows(model)
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *_persistent_buffers(model)]:
        source = sources.get(name)
        if source is None:
            if id(tensor) not in loaded:  # a tied weight stored once is fine
                report.missing.append(name)
            continue
        _copy_local(name, tensor, source, origin, packed.get(name))
        loaded.add(id(tensor))
        report.tensors += 1
        report.bytes_read += tensor.to_local().nbytes if isinstance(tensor, DTensor) else tensor.nbytes
    report.missing = [name for name in report.missing if id(_lookup(model, name)) not in loaded]
    if strict and report.missing:
        raise ShardedLoadError(f"{origin}: no checkpoint tensor for {', '.join(report.missing[:5])}")
    return report


def _sources(model, origin, where, leaf, weight_map, key_mapping, source_model, note) -> dict[str, LazyTensor]:
    """Model tensor → lazy source: from the recorded map, completed (or, without one,
    made) by the map derived from the checkpoint's own names."""
    sources: dict[str, LazyTensor] = {}
    try:
        if weight_map is not None:
            sources = weight_map_sources(model, RecordedMap.of(weight_map), leaf, where, note=note,
                                         key_mapping=key_mapping)
        wanted = set(model_tensor_names(model))
        if weight_map is None or not wanted <= set(sources):
            if weight_map is not None:
                _LOG.info(f"{origin}: the recorded weight map leaves {len(wanted - set(sources))} tensor(s) "
                          f"empty; deriving the mapping from the checkpoint's own names")
            derived = to_text(derive_weight_map(model, {key: leaf(key).shape for key in where},
                                                key_mapping=key_mapping, source_model=source_model))
            found = weight_map_sources(model, RecordedMap.of(derived), leaf, where, note=note, key_mapping=key_mapping)
            sources.update((name, src) for name, src in found.items() if name not in sources)
    except WeightMapError as exc:
        raise ShardedLoadError(f"{origin}: {exc}") from None
    return sources


def _note(report: ShardedLoadReport, line: str) -> None:
    """A converter read whole instead of by slices: kept in the report and logged as a warning."""
    report.notes.append(line)
    _LOG.warning(line)


def _lookup(model: torch.nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, leaf)


def _persistent_buffers(model: torch.nn.Module):
    """Buffers a checkpoint holds (non-persistent ones, like rotary caches, are recomputed)."""
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buf


def _copy_local(name: str, tensor: torch.Tensor, source: LazyTensor, origin: str,
                rows: PackedRows | None = None) -> None:
    if tuple(source.shape) != tuple(tensor.shape):
        raise ShardedLoadError(f"{origin}: {name}: checkpoint shape {tuple(source.shape)}, "
                               f"model expects {tuple(tensor.shape)}")
    full = [[(0, size)] for size in source.shape]
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        segments = local_segments(source.shape, tensor.placements, mesh.get_coordinate(), tuple(mesh.shape), rows)
        local = tensor.to_local()
        local.copy_(source.read(segments).to(local.dtype))
    else:
        tensor.copy_(source.read(full).to(tensor.dtype))


def materialize_and_load(model: torch.nn.Module, model_dir: str | Path, *, device: str | torch.device = "cpu",
                         strict: bool = True, key_mapping: dict[str, str] | None = None,
                         weight_map: dict[str, str | list[str]] | None = None) -> ShardedLoadReport:
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
    return load_sharded_safetensors(model, model_dir, strict=strict, key_mapping=key_mapping, weight_map=weight_map)


def materialize_as_fake(model: torch.nn.Module, device: str | torch.device) -> None:
    """Give a meta-device (already parallelized) model this rank's parameters and buffers as
    fake tensors on ``device``, under the active ``FakeTensorMode`` (``trainer dry-run
    --fake-tensors``): each DTensor keeps its mesh, placements and global shape over a fake
    local shard; a tied parameter stays one parameter. ``to_empty`` cannot do this: it swaps
    tensor internals, which fake tensors (weakly referenced by their mode) refuse."""
    from hyper_parallel.distributed.applier import reinstall_grad_hooks

    made: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, DTensor):
            local = tensor.to_local()
            local = torch.empty(local.shape, dtype=local.dtype, device=device)
            return DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False,
                                      shape=tensor.shape, stride=tensor.stride())
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)

    for module in model.modules():
        for slots, as_parameter in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in list(slots.items()):
                if tensor is None:
                    continue
                if id(tensor) not in made:
                    new = fake(tensor.detach())
                    made[id(tensor)] = torch.nn.Parameter(new, requires_grad=tensor.requires_grad) \
                        if as_parameter else new
                slots[name] = made[id(tensor)]
    reinstall_grad_hooks(model)
