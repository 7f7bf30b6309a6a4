"""A recorded weight map (``weight_map``) turned into lazy sources for the loader: per
model tensor, the checkpoint tensors that fill it and where, read by index ranges so a
rank reads only the part it keeps.

Checkpoint keys the map does not name load under their own name when the model has that
name (a checkpoint in the model's own layout, e.g. fused experts). Rules the map marks
``transformers(...)`` (operations no box can state) go through transformers' converter
on whole source tensors (``checkpoint_names.checkpoint_sources``), with a note.
"""

import itertools
import logging
from typing import Callable

import torch

from hyper_parallel.distributed import checkpoint_names
from hyper_parallel.distributed.checkpoint_names import LazyTensor, Segments
from hyper_parallel.distributed.weight_map import RecordedMap, Rule, WeightMapError

_LOG = logging.getLogger(__name__)


class Assembled(LazyTensor):
    """A model tensor made of boxes of checkpoint tensors (the rules naming it)."""

    def __init__(self, name: str, shape, parts: list[tuple[Rule, LazyTensor]]):
        self.name, self.shape = name, torch.Size(shape)
        self.parts = [(_resolved(name, self.shape, rule, leaf), leaf) for rule, leaf in parts]
        covered = sum(_volume(rule.index) for rule, _ in self.parts)
        if covered != self.shape.numel():
            raise WeightMapError(f"{name}: the checkpoint tensors the weight map names fill {covered} of its "
                                 f"{self.shape.numel()} elements ({', '.join(leaf.name for _, leaf in parts[:4])})")

    def read(self, segments: list[Segments]) -> torch.Tensor:
        """Each box's overlap with the selected ranges, read from its checkpoint tensor alone."""
        out = None
        shape = [sum(hi - lo for lo, hi in ranges) for ranges in segments]
        for rule, leaf in self.parts:
            pieces = [_overlaps(place, ranges) for place, ranges in zip(rule.index, segments)]
            for combo in itertools.product(*pieces):
                piece = self._read_piece(rule, leaf, combo)
                if out is None:
                    out = piece.new_empty(shape)
                out[tuple(slice(o, o + n) for o, _, n in combo)] = piece
        return out if out is not None else torch.empty(shape)

    @staticmethod
    def _read_piece(rule: Rule, leaf: LazyTensor, combo) -> torch.Tensor:
        """One box's overlap with one combination of selected ranges, in target order."""
        source = list(rule.source)
        free = [d for d, place in enumerate(rule.index) if not isinstance(place, int)]
        for d, leaf_dim in zip(free, rule.axes):
            _, rel, length = combo[d]
            lo = source[leaf_dim][0] + rel
            source[leaf_dim] = (lo, lo + length)
        piece = leaf.read([[r] for r in source])
        if list(rule.axes) != sorted(rule.axes):  # checkpoint dimensions in the target's order
            piece = piece.permute(*rule.axes)
        for d, place in enumerate(rule.index):
            if isinstance(place, int):
                piece = piece.unsqueeze(d)
        return piece


def _resolved(name: str, shape: torch.Size, rule: Rule, leaf: LazyTensor) -> Rule:
    """``rule`` with whole dimensions as explicit ranges and its sizes checked against
    the target's and the checkpoint tensor's shapes."""
    index = list(rule.index) + [None] * (len(shape) - len(rule.index))
    if len(index) != len(shape):
        raise WeightMapError(f"{name}: rule {rule.text()!r} has {len(rule.index)} indices for shape {tuple(shape)}")
    index = [(0, size) if place is None else place for place, size in zip(index, shape)]
    source = list(rule.source) + [None] * (len(leaf.shape) - len(rule.source))
    source = [(0, size) if r is None else r for r, size in zip(source, leaf.shape)]
    free = [place for place in index if not isinstance(place, int)]
    axes = rule.axes or tuple(range(len(free)))
    lengths = [hi - lo for lo, hi in free]
    if len(axes) != len(source) or lengths != [source[a][1] - source[a][0] for a in axes]:
        raise WeightMapError(f"{name}: checkpoint tensor {getattr(leaf, 'name', '?')} of shape {tuple(leaf.shape)} "
                             f"does not fit the weight map's rule {rule.text()!r} (shape {tuple(shape)})")
    return Rule(rule.target, tuple(index), tuple(source), tuple(axes))


def _volume(index) -> int:
    """Elements a resolved box covers."""
    out = 1
    for place in index:
        out *= 1 if isinstance(place, int) else place[1] - place[0]
    return out


def _overlaps(place, ranges: Segments) -> list[tuple[int, int, int]]:
    """(output offset, offset inside the box, length) for each selected range the box's
    extent along one dimension meets; an empty list when it meets none."""
    lo_box, hi_box = (place, place + 1) if isinstance(place, int) else place
    out, offset = [], 0
    for lo, hi in ranges:
        a, b = max(lo, lo_box), min(hi, hi_box)
        if a < b:
            out.append((offset + a - lo, a - lo_box, b - a))
        offset += hi - lo
    return out


def _is_whole(parts: list[tuple[Rule, LazyTensor]], shape) -> bool:
    """One checkpoint tensor that is the whole model tensor: read as it is (no assembly)."""
    if len(parts) != 1:
        return False
    rule, leaf = parts[0]
    return (rule.axes is None and all(i is None for i in rule.index)
            and all(r is None for r in rule.source) and tuple(leaf.shape) == tuple(shape))


def weight_map_sources(model: torch.nn.Module, recorded: RecordedMap, leaf: Callable[[str], LazyTensor],
                       checkpoint_keys, *, note: Callable[[str], None] | None = None,
                       key_mapping: dict[str, str] | None = None) -> dict[str, LazyTensor]:
    """Model tensor name → lazy source, from the recorded map and the checkpoint's keys."""
    names = set(checkpoint_names.model_tensor_names(model))
    shapes = {name: t.shape for name, t in [*model.named_parameters(remove_duplicate=False),
                                            *model.named_buffers(remove_duplicate=False)]}
    boxes: dict[str, list[tuple[Rule, LazyTensor]]] = {}
    own: dict[str, str] = {}
    via_transformers: set[str] = set()
    for key in checkpoint_keys:
        rules = recorded.rules_for(key)
        if rules is None:
            if key in names:
                own[key] = key
            continue
        for rule in rules:
            if rule.ops is not None:
                via_transformers.add(rule.target)
            elif rule.target in names:
                boxes.setdefault(rule.target, []).append((rule, leaf(key)))
    sources: dict[str, LazyTensor] = {}
    for name, parts in boxes.items():
        if name not in own:  # a tensor under the model's own name wins over boxes for it
            sources[name] = parts[0][1] if _is_whole(parts, shapes[name]) else Assembled(name, shapes[name], parts)
    sources.update((name, leaf(key)) for name, key in own.items())
    if via_transformers:
        converted = checkpoint_names.checkpoint_sources(model, leaf, checkpoint_keys, key_mapping=key_mapping,
                                                        note=note)
        sources.update((name, converted[name]) for name in via_transformers if name in converted)
    return sources
