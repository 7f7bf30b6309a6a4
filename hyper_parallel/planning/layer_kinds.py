"""Layer kinds: the decoder layers that plan alike, so that one of each is planned.

A 94-layer model has the plan entries of a 48-layer one (the frozen plan writes layers
``*``), but planning each layer and deriving each layer's weight map costs per layer.
Layers of one kind plan alike: the same modules under the same names and classes, the
same parameter and buffer shapes, dtypes and trainability, the same plain attributes
(a sliding window, a layer type; the layer's own index left out). Some layers are a kind
of their own whatever they hold: the first (where a split sequence enters the layers),
those the dataflow's tiny copy traced (their traced facts are their own,
``stand_ins.py``) and those sharing a tensor with another part of the model (Zamba's
shared block). Dense and MoE layers (``mlp_only_layers``), sliding and full attention,
linear-attention layers of a hybrid: each is its own kind by what it holds.

The first layer of a kind represents it. ``LayerKinds.view`` is the model with the
representatives alone, under their own indices (``LayerSubset``): what is planned once
for each kind, whose entries then stand for every layer of the kind.
"""

import copy
import functools
import re
import types
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from hyper_parallel.distributed.model_parts import LayerSubset, decoder_layers

_SIMPLE = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class LayerKinds:
    """The decoder layers (``layers_fqn``) by kind: ``kind_of[i]`` is the representative
    (first layer) of layer ``i``'s kind."""

    layers_fqn: str
    kind_of: tuple[int, ...]

    @functools.cached_property
    def representatives(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.kind_of)))

    @functools.cached_property
    def members(self) -> dict[int, tuple[int, ...]]:
        """Representative -> the layers of its kind, in order (itself first)."""
        found: dict[int, list[int]] = {}
        for index, representative in enumerate(self.kind_of):
            found.setdefault(representative, []).append(index)
        return {representative: tuple(layers) for representative, layers in found.items()}

    @property
    def reduces(self) -> bool:
        """Fewer kinds than layers: planning one of each saves work."""
        return len(self.representatives) < len(self.kind_of)

    def layer_of(self, fqn: str) -> int | None:
        """The index of the layer holding ``fqn`` (the layer itself included); None outside."""
        if not fqn.startswith(self.layers_fqn + "."):
            return None
        index = fqn[len(self.layers_fqn) + 1:].partition(".")[0]
        return int(index) if index.isdigit() else None

    def renamed(self, fqn: str, index: int) -> str:
        """``fqn`` in a representative's layer as the same module of layer ``index``."""
        rest = fqn[len(self.layers_fqn) + 1:].partition(".")[2]
        return f"{self.layers_fqn}.{index}" + (f".{rest}" if rest else "")

    def renamed_in_text(self, text: str, representative: int, index: int) -> str:
        """``text`` (a reason naming modules of the representative's layer) for layer ``index``."""
        own = re.escape(f"{self.layers_fqn}.{representative}")
        return re.sub(rf"{own}(?![\w])", f"{self.layers_fqn}.{index}", text)

    def view(self, model: nn.Module) -> nn.Module:
        """``model`` holding the representatives alone (a shallow copy of the modules on the
        way to the layers; every module and tensor shared, nothing of ``model`` changed)."""
        *path, name = self.layers_fqn.split(".")
        root = parent = _with_own_children(model)
        for step in path:
            parent._modules[step] = _with_own_children(parent._modules[step])
            parent = parent._modules[step]
        layers = parent._modules[name]
        parent._modules[name] = LayerSubset({index: layers[index] for index in self.representatives})
        return root


def planning_kinds(model: nn.Module, *, traced: Iterable[str] = ()) -> LayerKinds | None:
    """The kinds of ``model``'s decoder layers (module docstring); None without a list of
    layers. ``traced``: the module names of the dataflow's tiny copy, whose layers are
    each a kind of their own."""
    found = decoder_layers(model)
    if found is None or isinstance(found[1], LayerSubset):
        return None
    layers_fqn, layers = found
    alone = {0, *_traced_layers(traced, layers_fqn), *_sharing_layers(model, layers_fqn)}
    read = [_structure(layer) for layer in layers]
    own_index = _index_attributes(read)
    first_of: dict[tuple, int] = {}
    kind_of = []
    for index, modules in enumerate(read):
        key = (index if index in alone else None,
               tuple((name, cls, tensors, tuple(item for item in attributes if (name, item[0]) not in own_index))
                     for name, cls, tensors, attributes in modules))
        kind_of.append(first_of.setdefault(key, index))
    return LayerKinds(layers_fqn, tuple(kind_of))


def _traced_layers(module_names: Iterable[str], layers_fqn: str) -> set[int]:
    """The layer indices among a traced copy's module names (``Dataflow.classes``)."""
    prefix = layers_fqn + "."
    return {int(rest.partition(".")[0]) for name in module_names if name.startswith(prefix)
            and (rest := name[len(prefix):]).partition(".")[0].isdigit()}


def _with_own_children(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` whose children can be swapped without touching it."""
    copied = copy.copy(module)
    copied._modules = dict(module._modules)
    return copied


def _sharing_layers(model: nn.Module, layers_fqn: str) -> set[int]:
    """Layers holding a tensor that another layer or another part of the model holds too
    (weights tied across layers): planned on their own, as ``_tied_twin`` plans them."""
    holders: dict[int, set] = {}
    prefix = layers_fqn + "."
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        index = name[len(prefix):].partition(".")[0] if name.startswith(prefix) else ""
        holders.setdefault(id(tensor), set()).add(int(index) if index.isdigit() else -1)
    return {index for found in holders.values() if len(found) > 1 for index in found if index >= 0}


def _structure(layer: nn.Module) -> tuple:
    """What planning reads of one layer: per module its name, class, own tensors (shape,
    dtype, trainable) and plain attributes."""
    return tuple((name, type(module), _tensors(module), _attributes(module)) for name, module in layer.named_modules())


def _index_attributes(read: list[tuple]) -> set[tuple[str, str]]:
    """(module, attribute) pairs holding the layer's own index in every layer (``layer_idx``):
    left out of a kind, which would otherwise be one layer each."""
    values: dict[tuple[str, str], list[bool]] = {}
    for index, modules in enumerate(read):
        for name, _, _, attributes in modules:
            for attribute, value in attributes:
                values.setdefault((name, attribute), []).append(type(value) is int and value == index)
    return {pair for pair, equal in values.items() if all(equal)} if len(read) > 1 else set()


def _tensors(module: nn.Module) -> tuple:
    """The module's own parameters and buffers as (name, shape, dtype, trainable)."""
    own = [*module._parameters.items(), *module._buffers.items()]
    return tuple((name, None) if tensor is None else (name, tuple(tensor.shape), tensor.dtype, tensor.requires_grad)
                 for name, tensor in own)


def _attributes(module: nn.Module) -> tuple:
    """The module's public attributes, each as a comparable value: plain values as they
    are, functions and classes by name, tensors by shape and dtype, any other object by
    identity (one config object shared by every layer is one value; per-layer objects
    make per-layer kinds)."""
    return tuple((name, _comparable(value)) for name, value in vars(module).items()
                 if not name.startswith("_") and name != "training")


def _comparable(value):
    """``value`` as something equal for equal settings (see ``_attributes``)."""
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(item, _SIMPLE) for item in value):
        return type(value).__name__, tuple(value)
    if isinstance(value, functools.partial):
        return ("partial", _comparable(value.func), tuple(map(_comparable, value.args)),
                tuple(sorted((key, _comparable(item)) for key, item in value.keywords.items())))
    if isinstance(value, types.MethodType):
        return "method", _comparable(value.__func__)
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return getattr(value, "__module__", ""), getattr(value, "__qualname__", repr(value))
    if isinstance(value, torch.Tensor):
        return "tensor", tuple(value.shape), value.dtype
    if isinstance(value, torch.dtype):
        return str(value)
    return type(value), id(value)
