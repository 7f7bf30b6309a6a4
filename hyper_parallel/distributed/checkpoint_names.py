"""Which checkpoint tensors, through which of transformers' load-time operations, make
each model tensor — derived from transformers' own conversion mapping.

transformers 5 renames and restacks some families' saved tensors when it loads them
(``transformers.conversion_mapping``: ``WeightRenaming`` / ``WeightConverter`` entries,
collected per model by ``get_model_conversion_mapping``, the call ``from_pretrained``
makes). A Mixtral checkpoint, for instance, holds ``block_sparse_moe.experts.E.w1/w3``
per expert, and loading stacks them over experts and concatenates gate and up into the
model's ``mlp.experts.gate_up_proj``.

This module runs that same machinery without reading data:

* every checkpoint key goes through transformers' ``rename_source_key`` (all renamings,
  then at most one converter, then the base-model prefix), in transformers' key order,
  so the same keys feed the same parameter as in ``from_pretrained``;
* each converter then runs transformers' own operations (``MergeModulelist`` →
  ``torch.stack``, ``Concatenate`` → ``torch.cat``, ``Chunk``, ``Split``, ``Transpose``)
  on :class:`LazyTensor` placeholders, which record the operation instead of running
  it. Reading a recorded tensor by index ranges reads only the slices of the checkpoint
  tensors those ranges come from: a rank holding experts 2..3 reads only those
  experts' tensors, a tensor-parallel rank only its rows or columns.

An operation a placeholder cannot record (``Interleave``, ``PermuteForRope``,
quantization, ...) makes that one converter fall back: its source tensors are read
whole, transformers' operations run on them as in ``from_pretrained``, the result is
sliced, and a one-line note says so.
"""

import contextlib
import logging
import sys
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hyper_parallel.errors import HyperParallelError

_LOG = logging.getLogger(__name__)

Segments = list[tuple[int, int]]  # half-open index ranges along one dimension


class Unsliceable(TypeError, HyperParallelError):
    """A conversion operation a :class:`LazyTensor` cannot record; its converter falls back."""


# --- lazy tensors: shape now, data by index ranges later --------------------------------------------


class LazyTensor:
    """A tensor known by its shape; ``read(segments)`` returns the sub-tensor made of the
    given index ranges per dimension. The torch functions transformers' conversion
    operations call on it are recorded as new lazy tensors (``__torch_function__``);
    any other torch function raises :class:`Unsliceable`, and other tensor methods and
    arithmetic do not exist here, so nothing is ever silently computed on a placeholder."""

    shape: torch.Size

    def read(self, segments: list[Segments]) -> torch.Tensor:
        """The sub-tensor of the given ranges, reading no more of the checkpoint than it needs."""
        raise NotImplementedError

    def read_all(self) -> torch.Tensor:
        """The whole tensor (a fallback converter's source)."""
        return self.read([[(0, size)] for size in self.shape])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        handler = _RECORDED.get(func)
        if handler is None:
            raise Unsliceable(f"torch.{getattr(func, '__name__', func)}")
        return handler(*args, **(kwargs or {}))

    # The few tensor methods conversion operations call, recorded like their torch functions.

    def dim(self) -> int:
        """Number of dimensions (operations check it before choosing a dimension)."""
        return len(self.shape)

    def size(self, dim: int | None = None):
        """``Tensor.size``: operations size their pieces from it."""
        return self.shape if dim is None else self.shape[dim]

    def contiguous(self) -> "LazyTensor":
        """Layout is decided when read; every operation ends with ``.contiguous()``."""
        return self

    def transpose(self, dim0: int, dim1: int) -> "LazyTensor":
        """``Tensor.transpose`` recorded."""
        return Transposed(self, dim0, dim1)

    def chunk(self, chunks: int, dim: int = 0) -> tuple["LazyTensor", ...]:
        """``Tensor.chunk`` recorded."""
        return _chunk(self, chunks, dim)

    def split(self, split_size_or_sections, dim: int = 0) -> tuple["LazyTensor", ...]:
        """``Tensor.split`` recorded."""
        return _split(self, split_size_or_sections, dim)


class StoredTensor(LazyTensor):
    """One checkpoint tensor; its data is read slice by slice with ``safe_open(...).get_slice``."""

    def __init__(self, handle, name: str):
        self.name = name
        self.piece = handle.get_slice(name)
        self.shape = torch.Size(self.piece.get_shape())

    def read(self, segments: list[Segments]) -> torch.Tensor:
        return read_segments(self.piece, segments)


class InMemory(LazyTensor):
    """A tensor already computed (a fallback converter's output, or a real tensor a
    conversion operation mixed into recorded ones)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.shape = tensor.shape

    def read(self, segments: list[Segments]) -> torch.Tensor:
        return read_segments(self.tensor, segments)


class Stacked(LazyTensor):
    """``torch.stack(parts, dim)``: reads only the parts whose index lies in the ranges."""

    def __init__(self, parts: list[LazyTensor], dim: int):
        if not parts or any(p.shape != parts[0].shape for p in parts):
            raise ValueError(f"stack of shapes {[tuple(p.shape) for p in parts]}")
        self.parts = parts
        self.dim_ = _norm_dim(dim, len(parts[0].shape) + 1)
        shape = list(parts[0].shape)
        shape.insert(self.dim_, len(parts))
        self.shape = torch.Size(shape)

    def read(self, segments: list[Segments]) -> torch.Tensor:
        rest = segments[:self.dim_] + segments[self.dim_ + 1:]
        picked = [self.parts[i].read(rest) for lo, hi in segments[self.dim_] for i in range(lo, hi)]
        if not picked:
            return _empty(self.parts[0], _selected_shape(segments))
        return torch.stack(picked, dim=self.dim_)


class Concatenated(LazyTensor):
    """``torch.cat(parts, dim)``: each range along ``dim`` reads only the parts it overlaps."""

    def __init__(self, parts: list[LazyTensor], dim: int):
        self.dim_ = _norm_dim(dim, len(parts[0].shape))
        others = {tuple(s for d, s in enumerate(p.shape) if d != self.dim_) for p in parts}
        if len(others) != 1:
            raise ValueError(f"cat along {dim} of shapes {[tuple(p.shape) for p in parts]}")
        self.parts = parts
        shape = list(parts[0].shape)
        shape[self.dim_] = sum(p.shape[self.dim_] for p in parts)
        self.shape = torch.Size(shape)

    def read(self, segments: list[Segments]) -> torch.Tensor:
        pieces = []
        for lo, hi in segments[self.dim_]:
            offset = 0
            for part in self.parts:
                size = part.shape[self.dim_]
                lo_in, hi_in = max(lo, offset) - offset, min(hi, offset + size) - offset
                if lo_in < hi_in:
                    pieces.append(part.read(_replace(segments, self.dim_, [(lo_in, hi_in)])))
                offset += size
        if not pieces:
            return _empty(self.parts[0], _selected_shape(segments))
        return torch.cat(pieces, dim=self.dim_)


class Narrowed(LazyTensor):
    """``inner.narrow(dim, start, length)`` (one output of ``torch.chunk`` / ``torch.split``)."""

    def __init__(self, inner: LazyTensor, dim: int, start: int, length: int):
        self.inner, self.dim_, self.start = inner, _norm_dim(dim, len(inner.shape)), start
        shape = list(inner.shape)
        shape[self.dim_] = length
        self.shape = torch.Size(shape)

    def read(self, segments: list[Segments]) -> torch.Tensor:
        shifted = [(lo + self.start, hi + self.start) for lo, hi in segments[self.dim_]]
        return self.inner.read(_replace(segments, self.dim_, shifted))


class Transposed(LazyTensor):
    """``inner.transpose(dim0, dim1)``: the ranges of the two dimensions swap places."""

    def __init__(self, inner: LazyTensor, dim0: int, dim1: int):
        rank = len(inner.shape)
        self.inner, self.dim0, self.dim1 = inner, _norm_dim(dim0, rank), _norm_dim(dim1, rank)
        shape = list(inner.shape)
        shape[self.dim0], shape[self.dim1] = shape[self.dim1], shape[self.dim0]
        self.shape = torch.Size(shape)

    def read(self, segments: list[Segments]) -> torch.Tensor:
        swapped = list(segments)
        swapped[self.dim0], swapped[self.dim1] = segments[self.dim1], segments[self.dim0]
        return self.inner.read(swapped).transpose(self.dim0, self.dim1)


class Deferred(LazyTensor):
    """One output of a converter that could not be recorded: the first read runs the
    converter on its whole source tensors (once for all its outputs), then slices."""

    def __init__(self, group: "FallbackGroup", name: str, shape: torch.Size):
        self.group, self.name, self.shape = group, name, torch.Size(shape)

    def read(self, segments: list[Segments]) -> torch.Tensor:
        return read_segments(self.group.take(self.name), segments)


def read_segments(source, segments: list[Segments], dim: int = 0, prefix: tuple = ()) -> torch.Tensor:
    """``source[ranges]`` for several ranges per dimension (a ``_StridedShard`` gives more
    than one), concatenated in order; ``source`` is a safetensors slice or a tensor."""
    if dim == len(segments):
        return source[prefix]
    parts = [read_segments(source, segments, dim + 1, prefix + (slice(lo, hi),)) for lo, hi in segments[dim]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _norm_dim(dim: int, rank: int) -> int:
    """A non-negative dimension index (torch accepts negative ones)."""
    return dim % rank if rank else 0


def _replace(segments: list[Segments], dim: int, ranges: Segments) -> list[Segments]:
    """``segments`` with the ranges of one dimension replaced."""
    return segments[:dim] + [ranges] + segments[dim + 1:]


def _selected_shape(segments: list[Segments]) -> list[int]:
    """The shape ``read(segments)`` returns."""
    return [sum(hi - lo for lo, hi in ranges) for ranges in segments]


def _empty(like: LazyTensor, shape: list[int]) -> torch.Tensor:
    """An empty selection (an uneven shard can hold nothing) with the checkpoint's dtype,
    which only a zero-size read of a part can tell."""
    return like.read([[(0, 0)] for _ in like.shape]).new_empty(shape)


def _lazy(value) -> LazyTensor:
    """A recorded operation's operand: a real tensor becomes an :class:`InMemory` one."""
    if isinstance(value, LazyTensor):
        return value
    if isinstance(value, torch.Tensor):
        return InMemory(value)
    raise Unsliceable(f"operand of type {type(value).__name__}")


def _stack(tensors, dim: int = 0, *, out=None) -> LazyTensor:
    """``torch.stack`` recorded (``MergeModulelist``)."""
    if out is not None:
        raise Unsliceable("torch.stack(out=...)")
    return Stacked([_lazy(t) for t in tensors], dim)


def _cat(tensors, dim: int = 0, *, out=None) -> LazyTensor:
    """``torch.cat`` recorded (``Concatenate``)."""
    if out is not None:
        raise Unsliceable("torch.cat(out=...)")
    parts = [_lazy(t) for t in tensors]
    return parts[0] if len(parts) == 1 else Concatenated(parts, dim)


def _transpose(input, dim0: int, dim1: int) -> LazyTensor:
    """``torch.transpose`` recorded (``Transpose``)."""
    return Transposed(_lazy(input), dim0, dim1)


def _split_sizes(length: int, sizes) -> list[int]:
    """The piece lengths ``torch.split`` gives for an int size or a list of sizes."""
    if isinstance(sizes, int):
        return [min(sizes, length - start) for start in range(0, length, sizes)] or [0]
    if sum(sizes) != length:
        raise ValueError(f"split sizes {list(sizes)} do not add up to {length}")
    return list(sizes)


def _pieces(inner: LazyTensor, dim: int, sizes: list[int]) -> tuple[LazyTensor, ...]:
    """Consecutive narrow views of ``inner`` along ``dim``."""
    out, start = [], 0
    for size in sizes:
        out.append(Narrowed(inner, dim, start, size))
        start += size
    return tuple(out)


def _chunk(input, chunks: int, dim: int = 0) -> tuple[LazyTensor, ...]:
    """``torch.chunk`` recorded (``Chunk``): torch's piece sizes, ceil(length / chunks)."""
    inner = _lazy(input)
    length = inner.shape[_norm_dim(dim, len(inner.shape))]
    step = -(-length // chunks)
    return _pieces(inner, dim, _split_sizes(length, step) if step else [0])


def _split(tensor, split_size_or_sections, dim: int = 0) -> tuple[LazyTensor, ...]:
    """``torch.split`` recorded (``Split``)."""
    inner = _lazy(tensor)
    length = inner.shape[_norm_dim(dim, len(inner.shape))]
    return _pieces(inner, dim, _split_sizes(length, split_size_or_sections))


_RECORDED: dict[Callable, Callable] = {
    torch.stack: _stack, torch.cat: _cat, torch.concat: _cat, torch.concatenate: _cat,
    torch.transpose: _transpose, torch.swapaxes: _transpose, torch.swapdims: _transpose,
    torch.chunk: _chunk, torch.split: _split,
}


# --- transformers' conversion mapping for a model -----------------------------------------------------


def conversion_transforms(model: torch.nn.Module, key_mapping: dict[str, str] | None = None) -> list:
    """The ordered ``WeightRenaming`` / ``WeightConverter`` list ``from_pretrained`` uses
    for ``model`` (``transformers.conversion_mapping.get_model_conversion_mapping``, with
    a ``key_mapping`` as ``from_pretrained(..., key_mapping=...)`` takes one). A model that
    is not a ``PreTrainedModel`` (the custom backend) gets none: its names are its own."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping

    if not isinstance(model, PreTrainedModel):
        return []
    with _as_transformers_code(model):
        return get_model_conversion_mapping(model, key_mapping=key_mapping, hf_quantizer=None)


@contextlib.contextmanager
def _as_transformers_code(model: torch.nn.Module):
    """transformers converts checkpoints only for its own classes: it skips "custom code",
    any class defined outside ``transformers.``. A generated modeling file is a copy of
    transformers' own module (its ``HYPER_SOURCE_MODULE`` names it), and
    ``from_pretrained`` on the recipe's folder would build transformers' class — so for
    the lookup those sub-models count as transformers' own (an instance attribute
    shadows the ``is_custom_code`` classmethod, removed again on exit). Remote code (its
    source module is the model folder's) stays custom, as in ``from_pretrained``."""
    from transformers import PreTrainedModel

    copies = [module for module in model.modules()
              if isinstance(module, PreTrainedModel) and _is_transformers_copy(type(module))]
    for module in copies:
        module.is_custom_code = _false
    try:
        yield
    finally:
        for module in copies:
            del module.is_custom_code


def _false() -> bool:
    """``is_custom_code`` for a generated copy of a transformers class."""
    return False


def _is_transformers_copy(cls: type) -> bool:
    """``cls`` comes from a generated file whose source is a transformers module."""
    if not cls.is_custom_code():
        return False
    source = getattr(sys.modules.get(cls.__module__), "HYPER_SOURCE_MODULE", "")
    return isinstance(source, str) and source.startswith("transformers.")


# --- which checkpoint keys make which model tensor --------------------------------------------------


@dataclass
class ConverterGroup:
    """The checkpoint keys one (deep-copied) transformers ``WeightConverter`` collects for
    the parameter(s) it produces, in the order ``from_pretrained`` collects them."""

    template: Any
    first_target: str
    adds: list[tuple[str, str, str]] = field(default_factory=list)  # (target key, checkpoint key, pattern)

    def run(self, tensor_for: Callable[[str], Any], model: torch.nn.Module) -> dict[str, Any]:
        """transformers' own ``WeightConverter.convert`` on the tensors ``tensor_for``
        gives per checkpoint key (lazy, meta or real): full parameter name → result."""
        converter = deepcopy(self.template)
        for target, key, pattern in self.adds:
            converter.add_tensor(target, key, pattern, tensor_for(key))
        return converter.convert(self.first_target, model=model, config=getattr(model, "config", None))

    def run_recorded(self, tensor_for: Callable[[str], Any], model: torch.nn.Module) -> dict[str, "LazyTensor"]:
        """``run`` on lazy tensors, each output a recorded :class:`LazyTensor`; raises when
        an operation cannot be recorded."""
        return {name: _lazy(value) for name, value in _unwrap(self.run(tensor_for, model)).items()}

    def output_shapes(self, leaves: dict[str, Any], model: torch.nn.Module) -> dict[str, torch.Size] | None:
        """The outputs' names and shapes from a meta-device run (``leaves``: anything with a
        ``shape`` per source key); None when the operations need data."""
        return _meta_shapes(self, leaves, model, None)

    def source_keys(self) -> list[str]:
        """The checkpoint keys this converter reads, in collection order."""
        return [key for _, key, _ in self.adds]


@dataclass
class CheckpointRoutes:
    """Per model tensor name: the one checkpoint key it is read from (``renamed``), or the
    converter group that produces it (``groups``, keyed by the group's first target)."""

    renamed: dict[str, str] = field(default_factory=dict)
    groups: dict[str, ConverterGroup] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)


def route_checkpoint(model_names: list[str], checkpoint_keys, transforms: list,
                     base_model_prefix: str | None, *, in_load_order: bool = False) -> CheckpointRoutes:
    """transformers' key loop from ``convert_and_load_state_dict_in_model``, on names only:
    keys in transformers' order (some renamings are stateful; ``in_load_order``: the
    caller sorted them so already, a second sort of tens of thousands of keys is a tenth
    of a second), each renamed by ``rename_source_key``; a key the model already has
    keeps its name when renaming would lose it; converter keys are collected per target
    like ``from_pretrained``."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: conv for conv in converters for pattern in conv.source_patterns}
    wanted = dict.fromkeys(model_names, True)
    routes = CheckpointRoutes()
    for key in (checkpoint_keys if in_load_order else sorted(checkpoint_keys, key=dot_natural_key)):
        renamed, pattern = rename_source_key(key, renamings, converters, base_model_prefix, wanted)
        if renamed not in wanted and key in wanted:
            renamed, pattern = rename_source_key(key, [], [], base_model_prefix, wanted)
        if renamed not in wanted:
            routes.unexpected.append(key)
        elif pattern is None:
            routes.renamed.setdefault(renamed, key)
        else:
            group = routes.groups.setdefault(renamed, ConverterGroup(by_pattern[pattern], renamed))
            group.adds.append((renamed, key, pattern))
    return routes


# --- lazy sources for every model tensor ------------------------------------------------------------


class FallbackGroup:
    """A converter whose operations could not be recorded: its outputs are computed once,
    from whole source tensors, by transformers' operations, and handed out one by one."""

    def __init__(self, group: ConverterGroup, leaves: dict[str, StoredTensor], model: torch.nn.Module,
                 dtype: torch.dtype | None):
        self.group, self.leaves, self.model, self.dtype = group, leaves, model, dtype
        self.outputs: dict[str, torch.Tensor] | None = None
        self.pending: set[str] = set()

    def take(self, name: str) -> torch.Tensor:
        """Output ``name``; the outputs are dropped once each was taken."""
        if self.outputs is None:
            self.outputs = _unwrap(self.group.run(self._whole, self.model))
        tensor = self.outputs[name]
        self.pending.discard(name)
        if not self.pending:
            self.outputs = None
        return tensor

    def _whole(self, key: str) -> torch.Tensor:
        """A source tensor read whole, in the dtype ``from_pretrained`` casts it to."""
        tensor = self.leaves[key].read_all()
        return tensor.to(self.dtype) if self.dtype is not None else tensor


def model_tensor_names(model: torch.nn.Module) -> list[str]:
    """The names a checkpoint can fill: parameters (tied ones under each name) and
    persistent buffers — the keys of the model's state dict."""
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, _ in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                names.append(f"{module_name}.{name}" if module_name else name)
    return names


def checkpoint_sources(model: torch.nn.Module, leaf: Callable[[str], StoredTensor], checkpoint_keys,
                       *, key_mapping: dict[str, str] | None = None,
                       note: Callable[[str], None] | None = None) -> dict[str, LazyTensor]:
    """Model tensor name → a lazy tensor that reads it from the checkpoint (``leaf(key)``
    opens one checkpoint tensor), through the renamings and conversions
    ``from_pretrained`` would apply to this model."""
    routes = route_checkpoint(model_tensor_names(model), checkpoint_keys, conversion_transforms(model, key_mapping),
                              getattr(model, "base_model_prefix", None))
    sources: dict[str, LazyTensor] = {name: leaf(key) for name, key in routes.renamed.items()}
    for group in routes.groups.values():
        leaves = {key: leaf(key) for key in group.source_keys()}
        sources.update(_group_sources(model, group, leaves, note or _LOG.warning))
    return sources


def _group_sources(model: torch.nn.Module, group: ConverterGroup, leaves: dict[str, StoredTensor],
                   note: Callable[[str], None]) -> dict[str, LazyTensor]:
    """The converter's outputs as recorded lazy tensors; if an operation cannot be
    recorded, as :class:`Deferred` outputs of a :class:`FallbackGroup` (named and shaped
    by a meta-device run), with a note."""
    try:
        return group.run_recorded(leaves.__getitem__, model)
    except Exception as exc:  # noqa: BLE001 — any failure to record means: run it for real
        reason = exc
    dtype = _param_dtype(model, group.first_target)
    shapes = _meta_shapes(group, leaves, model, dtype)
    fallback = FallbackGroup(group, leaves, model, dtype)
    if shapes is None:  # not even on the meta device: compute now
        fallback.outputs = _unwrap(group.run(fallback._whole, model))
        shapes = {name: t.shape for name, t in fallback.outputs.items()}
    fallback.pending = set(shapes)
    ops = ", ".join(type(op).__name__ for op in getattr(group.template, "operations", []))
    why = f"{type(reason).__name__}: {(str(reason).splitlines() or [''])[0]}"
    note(f"{group.first_target}: transformers' conversion ({ops}) cannot be read by slices ({why}); "
         f"reading its {len(leaves)} source tensor(s) whole")
    return {name: Deferred(fallback, name, shape) for name, shape in shapes.items()}


def _meta_shapes(group: ConverterGroup, leaves: dict[str, StoredTensor], model: torch.nn.Module,
                 dtype: torch.dtype | None) -> dict[str, torch.Size] | None:
    """The converter's output names and shapes from a run on meta tensors; ``None`` if
    its operations need data."""
    def meta(key: str) -> torch.Tensor:
        return torch.empty(leaves[key].shape, dtype=dtype or torch.float32, device="meta")

    try:
        return {name: t.shape for name, t in _unwrap(group.run(meta, model)).items()}
    except Exception:  # noqa: BLE001 — a data-dependent operation: the real run will tell
        return None


def _unwrap(outputs: dict[str, Any]) -> dict[str, Any]:
    """A converter returns one value or a one-element list per target."""
    return {name: value[0] if isinstance(value, list) else value for name, value in outputs.items()}


def _param_dtype(model: torch.nn.Module, name: str) -> torch.dtype | None:
    """The dtype ``from_pretrained`` casts a converter's sources to: its target's."""
    try:
        return model.get_parameter(name).dtype
    except AttributeError:
        return None
