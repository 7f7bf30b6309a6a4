"""One forward of a tiny real model copy, with every tensor tagged by where its values come from.

The dataflow's first step (``dataflow.py`` reads the result). The forward runs under a
``TorchFunctionMode`` (``SourceTagMode``) that tags every tensor with the modules its
values come from:

- a module with its own parameters (and no parameterized children) re-tags its outputs
  with its own name; a norm (vector parameters only) is transparent when tags are
  resolved (``TagResolver``), so ``q_proj -> q_norm -> attention`` still reads as q_proj
  feeding attention;
- integer tensors (token ids, expert indices) select values, they carry none, so they
  add no tags to the floats they index;
- attention is seen where it happens: ``scaled_dot_product_attention``, or a product of
  two activations that goes through a softmax and then multiplies a third (eager);
- a router is a module whose output reaches ``topk`` (or a sort).

Hooks on the modules record, besides, each module's first input and output, which of its
inputs and outputs carry the stream, the parameters a module hands out of its forward
(``ParameterHandOuts``) and the modules called more than once: ``TracedForward``.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from hyper_parallel.distributed.model_parts import positional_names

_ATTENTION_FUNCTIONS = frozenset({"scaled_dot_product_attention", "flash_attn_func", "flex_attention"})
_MATMULS = frozenset({"matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm", "einsum"})
_SOFTMAXES = frozenset({"softmax", "_softmax", "log_softmax"})
_LINEAR_MAPS = _MATMULS | {"linear", "mm", "addmm"}
_SELECTIONS = frozenset({"topk", "sort", "argsort", "argmax"})
# New tensors shaped like another: they take its shape, not its values.
_FRESH = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "new_zeros",
                    "new_ones", "new_empty", "new_full", "new_tensor"})


class SourceTagMode(TorchFunctionMode):
    """Tags every tensor with the sources of its values (module docstring)."""

    def __init__(self):
        super().__init__()
        self.tags: dict[int, tuple[torch.Tensor, frozenset]] = {}
        self.pairs: list[tuple[frozenset, frozenset]] = []
        self.attention: list[tuple[frozenset, frozenset, frozenset]] = []
        self.selected: set = set()
        self.running: list[str] = []  # the tagged modules whose forward is running, innermost last
        self.holding: list[str] = []  # the modules with parameters of their own whose forward is running
        self.selecting: set[str] = set()  # tagged modules that select (top-k) inside their own forward
        self.owners: dict[int, str] = {}  # id(parameter) -> the module holding it (a leaf or a container)
        self.read_outside: set[str] = set()  # modules whose parameters code outside their forward used
        self.linears: set[str] = set()  # the tagged modules that are Linear
        self.weights: dict[int, tuple[torch.Tensor, str]] = {}  # a copy of a Linear's weight -> the Linear
        self.pending_weight: str | None = None

    def of(self, value) -> frozenset:
        entry = self.tags.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else frozenset()

    def set(self, value, tags: Iterable) -> None:
        if isinstance(value, torch.Tensor):
            self.tags[id(value)] = (value, frozenset(tags))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        for tensor in tensors if not _reads_placement_free_metadata(func) else ():
            owner = self.owners.get(id(tensor)) if isinstance(tensor, nn.Parameter) else None
            if owner is not None and self.holding[-1:] != [owner]:
                # Gemma 3n's layer clamps and multiplies AltUp's coefs itself; JetMoE's
                # attention calls its experts' ``reduce``, which adds their own bias
                self.read_outside.add(owner)
        values = [t for t in tensors if _carries_values(t) and not isinstance(t, nn.Parameter)]
        carried = frozenset().union(*(self.of(t) for t in values)) if values else frozenset()
        applied = self._weight_applied(name, tensors, values)
        if applied is not None:  # (also for a copy of the weight: ``.type(float32)``, ``.t()``)
            carried = frozenset({("mod", applied)})
        if name in _FRESH:
            carried = frozenset()
        elif name in _ATTENTION_FUNCTIONS and len(values) >= 3:
            self.attention.append((self.of(args[0]), self.of(args[1]), self.of(args[2])))
            carried = frozenset({("attn", len(self.attention) - 1)})
        elif name in _MATMULS:
            carried = self._matmul(values, carried)
        elif name in _SOFTMAXES:
            carried = frozenset(("probs", tag[1]) if tag[0] == "pair" else tag for tag in carried)
        elif name in _SELECTIONS:
            if self.running:  # a router module whose own forward picks the experts
                self.selecting.add(self.running[-1])
            else:
                self.selected |= carried
        if name.endswith("_") and not name.startswith("__") or name in ("__setitem__", "__iadd__", "__imul__"):
            target = args[0] if args else None
            if isinstance(target, torch.Tensor):
                self.set(target, self.of(target) | carried)
                # Writing into a view writes into its base (HY-V4 fills a fresh key tensor
                # through ``key[..., :d].copy_(k_nope)``): the base carries the values too.
                base = target._base
                if base is not None:
                    self.set(base, self.of(base) | carried)
        weight_copy, self.pending_weight = self.pending_weight, None
        for result in tree_flatten(out)[0]:
            if isinstance(result, torch.Tensor) and weight_copy is not None:
                self.weights[id(result)] = (result, weight_copy)
            if isinstance(result, torch.Tensor) and id(result) not in map(id, tensors):
                self.set(result, carried if _carries_values(result) else
                         carried | frozenset().union(*(self.of(t) for t in tensors)))
        return out

    def _weight_applied(self, name: str, tensors: list[torch.Tensor], values: list[torch.Tensor]) -> str | None:
        """The Linear whose weight this op applies outside the Linear's own forward
        (LongCat's router: ``F.linear(x, self.classifier.weight)``): its result is that
        projection's output, as if the module had run, so what it reaches (top-k: a router)
        is the projection's and not the input's (the stream's last writer, attention's
        o_proj). An op on the weight alone (a cast, a transpose) hands the mark on."""
        owner = None
        for tensor in tensors:
            entry = self.weights.get(id(tensor))
            if entry is not None and entry[0] is tensor:
                owner = entry[1]
            elif isinstance(tensor, nn.Parameter) and self.owners.get(id(tensor)) in self.linears \
                    and self.running[-1:] != [self.owners[id(tensor)]]:
                owner = self.owners[id(tensor)]
        if owner is None:
            return None
        if values:  # applied as a linear map, not looked up (a tied embedding's table) or added
            return owner if name in _LINEAR_MAPS else None
        self.pending_weight = owner  # the op's result (set in ``__torch_function__``) is a copy
        return None

    def _matmul(self, values: list[torch.Tensor], carried: frozenset) -> frozenset:
        """attention scores (a product of two activations), or probabilities times values."""
        operands = [t for t in values if self.of(t)]
        if len(operands) < 2:
            return carried
        first, second = operands[-2], operands[-1]
        probs = {tag[1] for tag in self.of(first) if tag[0] == "probs"}
        if probs:
            left, right = self.pairs[min(probs)]
            self.attention.append((left, right, self.of(second)))
            return frozenset({("attn", len(self.attention) - 1)})
        self.pairs.append((self.of(first), self.of(second)))
        return frozenset({("pair", len(self.pairs) - 1)})


@dataclass
class TracedForward:
    """What one traced forward recorded (``trace_forward``), by the traced copy's module names."""

    model: nn.Module
    mode: SourceTagMode
    inputs: dict[str, frozenset]
    first_input: dict[str, torch.Tensor]
    first_output: dict[str, torch.Tensor]
    leaves: dict[str, nn.Module]
    logits_tags: frozenset
    outputs: dict[str, frozenset]  # every other module: the tags of its first output
    output_dims: dict[str, int]  # every other module: its first output's number of dims
    value_inputs: dict[str, tuple[int, ...]]  # every other module: see Dataflow.value_inputs
    stream_inputs: dict[str, tuple[int, ...]]  # every other module: inputs shaped and carrying like the stream
    value_outputs: dict[str, tuple[int, ...]]  # every other module: see Dataflow.value_outputs
    misplaced_hand_outs: dict[str, str]  # see Dataflow.misplaced_hand_outs
    called_again: frozenset[str]  # leaves called more than once in the forward


# Properties of a parameter that its placement does not change: reading them outside the
# module (Mamba2's block casts its input to ``self.norm.weight.dtype``) uses no values.
# (Not ``shape``: a DTensor's is the global one, which code sizing local tensors would misread.)
_PLACEMENT_FREE_PROPERTIES = frozenset({"dtype", "device", "requires_grad", "is_cuda", "is_floating_point"})


def _reads_placement_free_metadata(func) -> bool:
    return getattr(func, "__name__", "") == "__get__" and getattr(
        getattr(func, "__self__", None), "__name__", "") in _PLACEMENT_FREE_PROPERTIES


def _carries_values(tensor: torch.Tensor) -> bool:
    """Floating and complex tensors carry values (rotary embeddings in complex form);
    integer and boolean ones select (ids, expert indices, masks)."""
    return tensor.is_floating_point() or tensor.is_complex()


def own_params(module: nn.Module) -> list[torch.Tensor]:
    return list(module.parameters(recurse=False))


def is_norm(module: nn.Module) -> bool:
    params = own_params(module)
    return bool(params) and all(p.dim() < 2 for p in params)


def _leaves(model: nn.Module) -> dict[str, nn.Module]:
    """Modules with their own parameters and no parameterized children: what the tags name."""
    return {name: module for name, module in model.named_modules()
            if own_params(module) and not any(own_params(child) for child in module.modules() if child is not module)}


def _first_float(value) -> torch.Tensor | None:
    return next((t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


class ParameterHandOuts:
    """Parameters a module hands out of its forward (GPT-NeoX-Japanese's attention returns
    its ``dense_bias``, which the decoder layer adds), and the modules that take another
    module's parameter as an input. The applier can place only a parameter handed out as
    it is, at the top of the output, and used by the caller's own code: ``misplaced``
    says why any other hand-out cannot be placed."""

    def __init__(self, model: nn.Module):
        self.owners = {id(param): (name, pname) for name, module in model.named_modules()
                       for pname, param in module.named_parameters(recurse=False)}
        self.handed: dict[str, str] = {}  # module -> how it hands out which parameter
        self.taken: dict[str, set[str]] = {}  # module -> modules that took one of its parameters

    def _owner(self, value) -> tuple[str, str] | None:
        if not isinstance(value, torch.Tensor):
            return None
        found = self.owners.get(id(value))
        base = value._base
        return found if found is not None else self.owners.get(id(base)) if base is not None else None

    def hook(self, name: str):
        def hook(module, args, kwargs, output):
            for value in tree_flatten((args, kwargs))[0]:
                owner = self._owner(value)
                if owner is not None and owner[0] != name and not name.startswith(owner[0] + "."):
                    self.taken.setdefault(owner[0], set()).add(name)
            top = output if isinstance(output, (tuple, list)) else (output,)
            for value in tree_flatten(output)[0]:
                owner = self._owner(value)
                if owner is None or owner[0] != name:
                    continue
                as_is = self.owners.get(id(value)) == owner and any(item is value for item in top)
                how = "as it is" if as_is else "as a view" if self.owners.get(id(value)) is None else "nested"
                self.handed.setdefault(name, f"{owner[1]} {how}")
        return hook

    def misplaced(self) -> dict[str, str]:
        found = {}
        for name, how in self.handed.items():
            if not how.endswith("as it is"):
                found[name] = f"hands out its parameter {how.replace('nested', 'inside a nested output')}"
            elif self.taken.get(name):
                takers = ", ".join(sorted(self.taken[name]))
                found[name] = f"hands out its parameter {how.split()[0]}, which {takers} takes as an input"
        return found


def trace_forward(model: nn.Module, input_ids: torch.Tensor) -> TracedForward:
    mode = SourceTagMode()
    hand_outs = ParameterHandOuts(model)
    leaves = _leaves(model)
    holders = {name: module for name, module in model.named_modules() if own_params(module)}
    mode.owners = {id(param): name for name, module in holders.items() for param in own_params(module)}
    mode.linears = {name for name, module in leaves.items() if isinstance(module, nn.Linear)}
    inputs: dict[str, frozenset] = {}
    first_input: dict[str, torch.Tensor] = {}
    first_output: dict[str, torch.Tensor] = {}

    calls: dict[str, int] = {}

    def pre(name):
        def hook(module, args, kwargs):
            floats = [t for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor) and _carries_values(t) and not isinstance(t, nn.Parameter)]
            calls[name] = calls.get(name, 0) + 1
            mode.running.append(name)
            inputs[name] = inputs.get(name, frozenset()).union(*(mode.of(t) for t in floats))
            if floats:
                first_input.setdefault(name, floats[0])
        return hook

    def post(name):
        def hook(module, args, kwargs, output):
            mode.running.pop()

            def retag(value):
                mode.set(value, {("mod", name)})
                return value
            tree_map(lambda v: retag(v) if isinstance(v, torch.Tensor) and _carries_values(v) else v, output)
            found = _first_float(output)
            if found is not None:
                first_output.setdefault(name, found)
        return hook

    outputs: dict[str, frozenset] = {}
    output_dims: dict[str, int] = {}
    value_inputs: dict[str, tuple[int, ...]] = {}
    stream_inputs: dict[str, tuple[int, ...]] = {}
    value_outputs: dict[str, tuple[int, ...]] = {}

    def record(name):
        def hook(module, args, kwargs, output):
            found = _first_float(output)
            if found is not None and name not in outputs:
                outputs[name], output_dims[name] = mode.of(found), found.dim()
                value_inputs[name], stream_inputs[name] = _value_positions(module, args, kwargs, mode)
                value_outputs[name] = _output_positions(output, found)
        return hook

    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_hook(hand_outs.hook(name), with_kwargs=True))
        if name and name not in leaves:
            handles.append(module.register_forward_hook(record(name), with_kwargs=True))
    for name, module in leaves.items():
        handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(module.register_forward_hook(post(name), with_kwargs=True))
    for name, module in holders.items():
        handles.append(module.register_forward_pre_hook(lambda *_, name=name: mode.holding.append(name)))
        handles.append(module.register_forward_hook(lambda *_: mode.holding.pop() and None))  # output kept
    try:
        with mode:
            output = model(input_ids=input_ids)
    finally:
        for handle in handles:
            handle.remove()
    logits = getattr(output, "logits", None)
    logits = logits if isinstance(logits, torch.Tensor) else _first_float(output)
    return TracedForward(model, mode, inputs, first_input, first_output, leaves, mode.of(logits), outputs, output_dims,
                  value_inputs, stream_inputs, value_outputs, hand_outs.misplaced(),
                  frozenset(name for name, count in calls.items() if count > 1))


def _output_positions(output, first: torch.Tensor) -> tuple[int, ...]:
    """Positions of a module's outputs shaped like its first float output (DBRX's
    norm_attn_norm returns the stream and its norm); a plain tensor output is (0,)."""
    if not isinstance(output, (tuple, list)):
        return (0,)
    return tuple(index for index, item in enumerate(output)
                 if isinstance(item, torch.Tensor) and item.is_floating_point() and item.shape == first.shape)


def _value_positions(module: nn.Module, args: tuple, kwargs: dict,
                     mode: "SourceTagMode") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Positions (in the forward's signature) of the first input carrying values from
    modules (not masks, ids or position tables computed from buffers) and of the inputs
    that carry the same values again (CTRL's attention: ``attn(x, x, x)``); and of every
    input shaped like that first one and carrying module values (Bloom's attention and MLP
    also take ``residual``, the stream before their norm)."""
    names = positional_names(module)
    given = sorted(list(enumerate(args)) + [(names.index(key), value) for key, value in kwargs.items()
                                            if key in names], key=lambda item: item[0])
    carrying = [(index, value) for index, value in given
                if isinstance(value, torch.Tensor) and _carries_values(value) and mode.of(value)]
    if not carrying:
        return (), ()
    first = carrying[0][1]  # the stream; others count only when they are the same values again
    return (tuple(index for index, value in carrying if value.shape == first.shape and mode.of(value) == mode.of(first)),
            tuple(index for index, value in carrying if value.shape == first.shape))


class TagResolver:
    """Tags -> the modules, attention calls and inputs they come from, through norms."""

    def __init__(self, trace: TracedForward):
        self.trace = trace
        self.norms = {name for name, module in trace.leaves.items() if is_norm(module)}

    def __call__(self, tags: Iterable, seen: frozenset = frozenset(), *, through_norms: bool = True) -> frozenset:
        out = set()
        for tag in tags:
            if tag[0] == "mod" and tag[1] in self.norms and through_norms:
                if tag[1] not in seen:
                    out |= self(self.trace.inputs.get(tag[1], ()), seen | {tag[1]})
            elif tag[0] in ("pair", "probs"):
                left, right = self.trace.mode.pairs[tag[1]]
                out |= self(left | right, seen, through_norms=through_norms)
            else:
                out.add(tag)
        return frozenset(out)
