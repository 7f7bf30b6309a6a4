"""The static weight mapping: for each checkpoint tensor name, which model tensor(s) it
fills, and which part of them — derived once, with transformers' own machinery, and
recorded as text (``codegen_meta.json``'s ``weight_map``).

Derivation (``derive_weight_map``) runs the same key loop and the same conversion
operations as ``from_pretrained`` (``checkpoint_names``), on shape-only placeholders,
and reads back where each checkpoint tensor ended up: a box of the parameter (a
stacking index or a slice per dimension), a slice of the checkpoint tensor, a
permutation of its dimensions. A ``replace_module`` replacement that renames or
restacks its parameters declares it the way transformers does for a model class, as
``checkpoint_conversion`` (a list of transformers ``WeightRenaming`` /
``WeightConverter`` with patterns relative to the module), and is composed on top.

The recorded form, one line per name pattern (layer and expert indices written ``*``,
as the frozen plan writes layers)::

    "model.layers.*.mlp.experts.*.gate_proj.weight": "model.layers.*.mlp.experts.gate_up_proj[*, 0:32]"
    "model.layers.*.self_attn.q_proj.weight": "model.layers.*.self_attn.q_proj.weight"

The value's ``*`` take the key's ``*`` values in order (names first, then indices). A
value is a rule or a list of rules (one checkpoint tensor split over parameters):

- ``T`` — the whole checkpoint tensor is the whole of ``T``;
- ``T[i, a:b]`` — it fills that part of ``T``: an integer is a stacking position (the
  checkpoint tensor lacks that dimension), ``a:b`` a slice, ``:`` or a missing trailing
  index the whole dimension;
- ``T[...] = [a:b, :]`` — only that slice of the checkpoint tensor, optionally
  ``.permute(1, 0)``: its dimensions in the order they take in ``T``;
- ``T = transformers(Interleave)`` — an operation that moves data in ways a box cannot
  say; the loader runs transformers' converter on the whole source tensors.
"""

import logging
import re
from copy import deepcopy
from dataclasses import dataclass
from typing import Protocol

import torch

from hyper_parallel.distributed import checkpoint_names
from hyper_parallel.distributed.checkpoint_names import (
    Concatenated,
    LazyTensor,
    Narrowed,
    Stacked,
    Transposed,
    Unsliceable,
)
from hyper_parallel.errors import HyperParallelError

_LOG = logging.getLogger(__name__)

Index = int | tuple[int, int] | None  # stacking position, slice, or the whole dimension (None)
_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


class WeightMapError(ValueError, HyperParallelError):
    """A weight map that cannot be derived or read; names the tensor or the line."""


@dataclass(frozen=True)
class Rule:
    """Where one checkpoint tensor goes: ``target[index] = checkpoint[source].permute(axes)``.

    ``index`` has one entry per target dimension (``None``: whole), ``source`` one per
    checkpoint dimension (``None``: whole), ``axes`` the checkpoint dimensions in the order
    of the target's non-stacking dimensions (``None``: in order). ``ops`` marks a rule no
    box can state: the transformers operations the loader must run."""

    target: str
    index: tuple[Index, ...] = ()
    source: tuple[tuple[int, int] | None, ...] = ()
    axes: tuple[int, ...] | None = None
    ops: str | None = None

    def text(self) -> str:
        """The rule as recorded (see the module docstring)."""
        if self.ops is not None:
            return f"{self.target} = transformers({self.ops})"
        out = self.target + _brackets(self.index)
        if any(r is not None for r in self.source) or self.axes is not None:
            out += " = " + (_brackets(self.source) or "[:]")
            if self.axes is not None:
                out += f".permute({', '.join(map(str, self.axes))})"
        return out


def _brackets(items) -> str:
    """``[a, b:c]`` with trailing whole dimensions left out; empty when all are whole."""
    items = list(items)
    while items and items[-1] is None:
        items.pop()
    if not items:
        return ""
    return "[" + ", ".join(":" if i is None else str(i) if isinstance(i, int) else f"{i[0]}:{i[1]}"
                           for i in items) + "]"


_RULE = re.compile(r"^(?P<target>[^\[\] =]+)(?P<index>\[[^\]]*\])?"
                   r"(?: = (?:transformers\((?P<ops>[^)]*)\)|(?P<source>\[[^\]]*\])(?:\.permute\((?P<axes>[\d, ]*)\))?))?$")


def parse_rule(text: str) -> Rule:
    """A recorded rule back as a :class:`Rule` (the inverse of :meth:`Rule.text`)."""
    found = _RULE.match(text)
    if found is None:
        raise WeightMapError(f"weight map: cannot read rule {text!r}")
    if found["ops"] is not None:
        return Rule(found["target"], ops=found["ops"])
    index = tuple(_parse_item(item, text) for item in _items(found["index"]))
    source = tuple(_parse_item(item, text) for item in _items(found["source"]))
    if any(isinstance(item, int) for item in source):
        raise WeightMapError(f"weight map: {text!r}: a checkpoint slice takes ranges, not positions")
    axes = tuple(int(a) for a in found["axes"].split(",")) if found["axes"] else None
    return Rule(found["target"], index, source, axes)


def _items(brackets: str | None) -> list[str]:
    """The comma-separated items inside ``[...]`` (none for no brackets)."""
    return [item.strip() for item in brackets[1:-1].split(",")] if brackets else []


def _parse_item(item: str, text: str) -> Index:
    """``:`` → None, ``a:b`` → (a, b), ``i`` → i."""
    try:
        if item == ":":
            return None
        if ":" in item:
            lo, hi = item.split(":")
            return int(lo), int(hi)
        return int(item)
    except ValueError:
        raise WeightMapError(f"weight map: {text!r}: cannot read index {item!r}") from None


# --- derivation: where each checkpoint tensor lands, traced on placeholders ------------------------


class ShapeLeaf(LazyTensor):
    """A checkpoint tensor known by name and shape only (derivation reads no data)."""

    def __init__(self, name: str, shape):
        # (a checkpoint's layout is tens of thousands of these: no copy of a Size already)
        self.name, self.shape = name, shape if type(shape) is torch.Size else torch.Size(shape)

    def read(self, segments):
        raise WeightMapError(f"{self.name}: a shape-only placeholder has no data")


@dataclass
class _Box:
    """One checkpoint tensor's place in a traced result: per result dimension its index
    (int: stacking position; (lo, hi): range) and the checkpoint dimension it runs along
    (None for a stacking position); per checkpoint dimension the range used."""

    key: str
    dst: list
    leaf_dims: list
    src: list


def trace_boxes(lazy: LazyTensor) -> list[_Box]:
    """The boxes a recorded operation tree is made of; :class:`Unsliceable` for a part
    that is not a checkpoint tensor moved by stack / cat / narrow / transpose."""
    if isinstance(lazy, (ShapeLeaf, checkpoint_names.StoredTensor)):
        rank = len(lazy.shape)
        return [_Box(lazy.name, [(0, s) for s in lazy.shape], list(range(rank)), [(0, s) for s in lazy.shape])]
    if isinstance(lazy, Stacked):
        out = []
        for i, part in enumerate(lazy.parts):
            for box in trace_boxes(part):
                box.dst.insert(lazy.dim_, i)
                box.leaf_dims.insert(lazy.dim_, None)
                out.append(box)
        return out
    if isinstance(lazy, Concatenated):
        out, offset = [], 0
        for part in lazy.parts:
            for box in trace_boxes(part):
                lo, hi = box.dst[lazy.dim_]
                box.dst[lazy.dim_] = (lo + offset, hi + offset)
                out.append(box)
            offset += part.shape[lazy.dim_]
        return out
    if isinstance(lazy, Narrowed):
        return [box for box in (_narrow(b, lazy.dim_, lazy.start, lazy.shape[lazy.dim_])
                                for b in trace_boxes(lazy.inner)) if box is not None]
    if isinstance(lazy, Transposed):
        out = trace_boxes(lazy.inner)
        for box in out:
            for seq in (box.dst, box.leaf_dims):
                seq[lazy.dim0], seq[lazy.dim1] = seq[lazy.dim1], seq[lazy.dim0]
        return out
    raise Unsliceable(type(lazy).__name__)


def _narrow(box: _Box, dim: int, start: int, length: int) -> _Box | None:
    """``box`` seen through ``narrow(dim, start, length)``: cut, shifted, or gone."""
    place = box.dst[dim]
    if isinstance(place, int):
        if not start <= place < start + length:
            return None
        box.dst[dim] = place - start
        return box
    lo, hi = max(place[0], start), min(place[1], start + length)
    if lo >= hi:
        return None
    leaf_dim = box.leaf_dims[dim]
    src_lo = box.src[leaf_dim][0] + lo - place[0]
    box.src[leaf_dim] = (src_lo, src_lo + hi - lo)
    box.dst[dim] = (lo - start, hi - start)
    return box


def _rule(target: str, target_shape, box: _Box, leaf_shape) -> Rule:
    """A traced box as a rule, whole dimensions written as such."""
    index = tuple(None if isinstance(d, tuple) and d == (0, size) else d for d, size in zip(box.dst, target_shape))
    source = tuple(None if r == (0, size) else r for r, size in zip(box.src, leaf_shape))
    axes = tuple(d for d in box.leaf_dims if d is not None)
    return Rule(target, index, source, None if list(axes) == sorted(axes) else axes)


def derive_weight_map(model: torch.nn.Module, checkpoint_shapes: dict[str, torch.Size], *,
                      key_mapping: dict[str, str] | None = None,
                      names_before_replacement: list[str] | None = None,
                      source_model: torch.nn.Module | None = None) -> dict[str, list[Rule]]:
    """Checkpoint key → its rules, for a checkpoint holding ``checkpoint_shapes``.

    Without ``names_before_replacement`` or ``source_model`` the model's own names are
    transformers' targets (no replacement renamed anything). With
    ``names_before_replacement`` (derive, which builds the model both ways), checkpoint
    keys go to those names first, then through the replacements' declared
    ``checkpoint_conversion`` to the model's names. With ``source_model`` (the custom
    backend: a ``models/common`` model beside the HF model of the same config, on meta),
    checkpoint keys go through transformers' conversion to the HF model's names first,
    then through the ``checkpoint_conversion`` the model's classes declare."""
    from transformers.core_model_loading import dot_natural_key

    first = source_model if source_model is not None else model
    wanted = (checkpoint_names.model_tensor_names(source_model) if source_model is not None
              else names_before_replacement or checkpoint_names.model_tensor_names(model))
    # transformers' key order (numbers as numbers, never int against str), layer by layer
    order = sorted(checkpoint_shapes, key=dot_natural_key)
    leaf = {key: ShapeLeaf(key, checkpoint_shapes[key]) for key in order}
    sources, opaque, _ = _convert(first, wanted, leaf, checkpoint_names.conversion_transforms(first, key_mapping),
                                  getattr(first, "base_model_prefix", None), in_load_order=True)
    if names_before_replacement is not None or source_model is not None:
        sources, later_opaque, unplaced = _convert(model, checkpoint_names.model_tensor_names(model), sources,
                                                   replacement_transforms(model), None)
        opaque += later_opaque
        if source_model is None:
            _check_replaced(model, wanted, sources, {target for target, _, _ in opaque})
        elif unplaced:  # (a tensor left empty is the loader's error, naming it)
            raise WeightMapError(f"{type(source_model).__name__} tensors {unplaced[:4]} have no place in "
                                 f"{type(model).__name__} (no checkpoint_conversion of its classes renames them "
                                 f"to one of its tensors); the custom model lacks that part of the model")
    shapes = _tensor_shapes(model)
    rules: dict[str, list[Rule]] = {}
    for target, lazy in sources.items():
        try:
            boxes = trace_boxes(lazy)
        except Unsliceable:
            opaque.append((target, _leaf_keys(lazy), "mixed"))
            continue
        for box in boxes:
            rules.setdefault(box.key, []).append(_rule(target, shapes.get(target, lazy.shape), box,
                                                       checkpoint_shapes[box.key]))
    for target, keys, ops in opaque:
        for key in keys:
            rules.setdefault(key, []).append(Rule(target, ops=ops))
    return {key: rules[key] for key in order if key in rules}


def _convert(model, wanted: list[str], leaf: dict[str, LazyTensor], transforms: list, prefix: str | None, *,
             in_load_order: bool = False):
    """One pass of transformers' key loop over ``leaf`` (name → placeholder tree):
    target name → tree, the converters that could not be recorded, as (target, source
    keys, operations), and the keys no target takes. ``in_load_order``: ``leaf``'s
    names are in transformers' order already."""
    routes = checkpoint_names.route_checkpoint(wanted, list(leaf), transforms, prefix, in_load_order=in_load_order)
    sources = {name: leaf[key] for name, key in routes.renamed.items()}
    opaque = []
    for group in routes.groups.values():
        try:
            sources.update(group.run_recorded(leaf.__getitem__, model))
        except Exception:  # noqa: BLE001 — any failure to record means: transformers runs it for real
            ops = ", ".join(type(op).__name__ for op in getattr(group.template, "operations", []))
            keys = [k for key in group.source_keys() for k in _leaf_keys(leaf[key])]
            shapes = group.output_shapes(leaf, model) or {group.first_target: None}
            for target in sorted(shapes):
                opaque.append((target, keys, ops or type(group.template).__name__))
    return sources, opaque, routes.unexpected


def _leaf_keys(lazy: LazyTensor) -> list[str]:
    """The checkpoint keys a tree reads (for a rule that cannot be a box)."""
    if isinstance(lazy, (ShapeLeaf, checkpoint_names.StoredTensor)):
        return [lazy.name]
    children = getattr(lazy, "parts", None) or [getattr(lazy, "inner", None)]
    return [key for child in children if isinstance(child, LazyTensor) for key in _leaf_keys(child)]


def replacement_transforms(model: torch.nn.Module) -> list:
    """The ``checkpoint_conversion`` each module's class declares (transformers
    ``WeightRenaming`` / ``WeightConverter`` with module-relative patterns, or a
    ``(source, target)`` pattern pair for a plain renaming, so a torch-only module needs
    no transformers import), scoped to the module's name as transformers scopes a
    sub-model's mapping; outer modules first, so their renamings run before the inner
    ones' scopes are matched."""
    from transformers.core_model_loading import WeightRenaming

    out = []
    for name, module in model.named_modules():
        for transform in getattr(type(module), "checkpoint_conversion", None) or ():
            scoped = WeightRenaming(*transform) if isinstance(transform, tuple) else deepcopy(transform)
            scoped.scope_prefix = name
            out.append(scoped)
    return out


def _check_replaced(model, before: list[str], sources: dict, converted_whole: set[str]) -> None:
    """Every name the model has is filled (by a box, or by a converter run whole); a
    replacement that renamed parameters without declaring ``checkpoint_conversion``
    leaves some empty, named here. A tied weight stored once fills its other names."""
    now = checkpoint_names.model_tensor_names(model)
    filled = {id(tensor) for name, tensor in _named_tensors(model) if name in sources or name in converted_whole}
    empty = [name for name, tensor in _named_tensors(model) if name in now and id(tensor) not in filled]
    if empty:
        lost = sorted(set(before) - set(now))
        raise WeightMapError(f"model tensors {empty[:4]} have no checkpoint tensor after the replacements (names "
                             f"that disappeared: {lost[:4]}); a replace_module target (or a custom-backend "
                             f"module) that renames or restacks parameters declares checkpoint_conversion "
                             f"(transformers WeightRenaming / WeightConverter, patterns relative to the module)")


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers under every name (tied ones too)."""
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


def _tensor_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    """Every state-dict tensor's shape (tied ones under each name)."""
    shapes = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}
    shapes.update((name, b.shape) for name, b in model.named_buffers(remove_duplicate=False))
    return shapes


def saved_layout(model: torch.nn.Module) -> dict[str, torch.Size]:
    """The tensor names and shapes ``save_pretrained`` writes for ``model`` (a meta
    model will do): tied weights stored once, transformers' conversion reverted."""
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    if not isinstance(model, PreTrainedModel):
        return {name: t.shape for name, t in state.items()}
    state = revert_weight_conversion(model, remove_tied_weights_from_state_dict(state, model))
    return {name: t.shape for name, t in state.items()}


# --- the recorded text: one line per name pattern ----------------------------------------------------


class KeyCopies(Protocol):
    """The keys of every layer one key stands for, where the rules were derived on one
    layer of each kind (``planning/weight_map_by_kind.py``)."""

    def count(self, key: str) -> int: ...

    def names(self, key: str) -> list[str]: ...


def to_text(rules: dict[str, list[Rule]], *, stands_for: KeyCopies | None = None) -> dict[str, str | list[str]]:
    """The map as recorded: keys whose rules differ only in their layer / expert indices
    share one line under a ``*`` pattern; a pattern is only used when it matches exactly
    its members among the map's keys.

    ``stands_for``: where ``rules`` were derived on one layer of each kind, the keys of
    every layer a key stands for (``planning/weight_map_by_kind.py``; each of its rules a
    template of its indices): a pattern counts them all, and one left exact lists them,
    rules filled in with their indices, in transformers' key order."""
    concrete = {key: [r.text() for r in rs] for key, rs in rules.items()}
    out: dict[str, list[str]] = {}
    groups: dict[str, list[str]] = {}
    for key in concrete:
        groups.setdefault(_INDEX.sub(".*", key), []).append(key)
    # A key matches a pattern's regex exactly when it has that pattern (a '*' stands for a
    # whole dotted number, what _INDEX replaces), so a pattern matches its members only —
    # unless a key holds a '*' of its own, which only a scan of every key can rule out.
    scan = any("*" in key for key in concrete)
    for pattern, members in groups.items():
        templated = {tuple(rule_template(key, text) or "" for text in concrete[key]) for key in members}
        count = sum(stands_for.count(key) for key in members) if stands_for is not None else len(members)
        if (count > 1 and len(templated) == 1 and "" not in next(iter(templated))
                and (not scan or sum(1 for key in concrete if compile_pattern(pattern).match(key)) == len(members))):
            out[pattern] = list(next(iter(templated)))
        elif stands_for is None:
            out.update((key, concrete[key]) for key in members)
        else:
            out.update(_every_layers_keys(members, concrete, stands_for))
    return {key: texts[0] if len(texts) == 1 else texts for key, texts in out.items()}


def _every_layers_keys(members: list[str], concrete: dict[str, list[str]],
                       stands_for: KeyCopies) -> list[tuple[str, list[str]]]:
    """A pattern's keys written exactly, each member as every key it stands for, its rules
    filled in with that key's indices, in transformers' key order."""
    from transformers.core_model_loading import dot_natural_key

    found = []
    for key in members:
        for name in stands_for.names(key):
            texts = concrete[key] if name == key else [
                _fill(name, rule_template(key, text), tuple(_INDEX.findall(name))) for text in concrete[key]]
            found.append((name, texts))
    return sorted(found, key=lambda item: dot_natural_key(item[0]))


_TEMPLATABLE = re.compile(r"(?<=\.)\d+(?=\.|\[|$| )|(?<=[\[ ])\d+(?=[,\]])")


def rule_template(key: str, text: str) -> str | None:
    """``text`` with the key's indices written ``*``, when its name indices then stacking
    positions are exactly the key's indices in order; else None (recorded exactly)."""
    target, sep, rest = text.partition(" = ")
    if _TEMPLATABLE.findall(target) != _INDEX.findall(key):
        return None
    return _TEMPLATABLE.sub("*", target) + sep + rest


def compile_pattern(pattern: str) -> re.Pattern:
    """A recorded key pattern as a regex whose groups are its ``*`` (indices)."""
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"(\d+)") + "$")


@dataclass
class RecordedMap:
    """A recorded weight map, ready to expand checkpoint keys into rules."""

    exact: dict[str, list[str]]
    patterns: list[tuple[re.Pattern, list[str]]]

    @classmethod
    def of(cls, recorded: dict[str, str | list[str]]) -> "RecordedMap":
        """Parse the JSON form (``to_text``'s result)."""
        exact, patterns = {}, []
        for key, value in recorded.items():
            texts = [value] if isinstance(value, str) else list(value)
            if "*" in key:
                patterns.append((compile_pattern(key), texts))
            else:
                exact[key] = texts
        return cls(exact, patterns)

    def rules_for(self, key: str) -> list[Rule] | None:
        """The rules of checkpoint key ``key``; None when the map does not name it."""
        if key in self.exact:
            return [parse_rule(text) for text in self.exact[key]]
        for pattern, texts in self.patterns:
            found = pattern.match(key)
            if found:
                return [parse_rule(_fill(key, text, found.groups())) for text in texts]
        return None


def _fill(key: str, text: str, values: tuple[str, ...]) -> str:
    """A rule's ``*`` replaced by the key's indices, in order."""
    if text.count("*") != len(values):
        raise WeightMapError(f"weight map: rule {text!r} for {key!r}: its '*' do not match the key's indices")
    pieces = text.split("*")
    return "".join(piece + value for piece, value in zip(pieces, values)) + pieces[-1]


def weight_map_text(model: torch.nn.Module, *, names_before_replacement: list[str] | None = None,
                    hf_model: torch.nn.Module | None = None) -> dict[str, str | list[str]]:
    """What codegen records: the map from the layout ``save_pretrained`` writes for the
    HF model (``hf_model``, before replacements; ``model`` itself when there are none)."""
    layout = saved_layout(hf_model if hf_model is not None else model)
    return to_text(derive_weight_map(model, layout, names_before_replacement=names_before_replacement))
