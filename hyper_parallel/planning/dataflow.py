"""Roles from dataflow: what each module does, read from one forward of a tiny real copy.

The planner's names and TP-plan hints say what a module is called; this module says what
it does. One forward of a tiny random-weight instance of the model (the recipe's config
with the verify probe's widths, full depth, replacements applied) runs under a
``TorchFunctionMode`` that tags every tensor with the modules its values come from:

- a module with its own parameters (and no parameterized children) re-tags its outputs
  with its own name; a norm (vector parameters only) is transparent when tags are
  resolved, so ``q_proj -> q_norm -> attention`` still reads as q_proj feeding attention;
- integer tensors (token ids, expert indices) select values, they carry none, so they
  add no tags to the floats they index;
- attention is seen where it happens: ``scaled_dot_product_attention``, or a product of
  two activations that goes through a softmax and then multiplies a third (eager);
- a router is a module whose output reaches ``topk`` (or a sort).

From the tags: the **stream** is everything the output head reads (the embeddings and
every module that adds to the residual stream); a **block** is a set of projections
joined by edges that do not go through the stream (q/k/v -> attention -> o; gate, up ->
down; fc_in -> fc_out of one expert; MLA's chains), with its **consumers** (the members
that write to the stream), its **producers** (the members that read it) and inner members.

Whether a block can be split over ``tp`` the Megatron way (producers colwise, consumer
rowwise) is measured, not assumed: for every tp rank, the gradient of that rank's slice
of the consumer's input features with respect to every member's output says which of the
member's output features that rank needs. The block splits when each feature is needed by
at most one rank and the owners form a layout the roles have: contiguous rows
(``colwise``; per-head fused layouts such as Bloom's), or 2 or 3 equal packed parts each
split over tp (``fused_gate_up`` / ``fused_qkv``). A dry run then checks that the model's
own code runs on those local widths (a reshape with the global head count does not). A
block that fails either check is planned **gathered**: each member computes its rows and
hands on all of them (``colwise_gathered``), the consumer slices its input
(``rowwise_split_input``): exact for any dataflow, weights still split, the inner
computation not. Fused projections whose q/k/v parts differ in width (GQA) land here.
"""

import copy
import inspect
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from hyper_parallel.distributed.model_parts import (
    decoder_layers,
    input_embeddings,
    output_embeddings,
    positional_names,
)
from hyper_parallel.distributed.local_views import block_sizes, local_piece, local_sizes, owner_of, packed_blocks_piece
from hyper_parallel.planning.sequence_dry_run import check_sequence_split, is_attention, whole_over_cp
from hyper_parallel.planning.handoff_check import handoff_blocks, recurrent_candidates
from hyper_parallel.planning.token_attention_dry_run import token_attention_refusals

SPLIT_MODE, GATHERED_MODE, WHOLE_MODE = "split", "gathered", "whole"
_ATTENTION_FUNCTIONS = frozenset({"scaled_dot_product_attention", "flash_attn_func", "flex_attention"})
_MATMULS = frozenset({"matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm", "einsum"})
_SOFTMAXES = frozenset({"softmax", "_softmax", "log_softmax"})
_LINEAR_MAPS = _MATMULS | {"linear", "mm", "addmm"}
_SELECTIONS = frozenset({"topk", "sort", "argsort", "argmax"})
# New tensors shaped like another: they take its shape, not its values.
_FRESH = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "new_zeros",
                    "new_ones", "new_empty", "new_full", "new_tensor"})
# Roles a block member can get, by the layout its rank owners form (parts split over tp).
_SPLIT_ROLE_BY_PARTS = {1: "colwise", 2: "fused_gate_up", 3: "fused_qkv"}
# The parent computing a block on its heads, and a child whose parameters it places (HeadSplit).
HEAD_SPLIT_ROLE, PLACED_BY_PARENT_ROLE, COLWISE_BY_PARENT_ROLE = "head_split", "placed_by_parent", "colwise_by_parent"
_HEAD_ROLES = frozenset({HEAD_SPLIT_ROLE, PLACED_BY_PARENT_ROLE, COLWISE_BY_PARENT_ROLE})


@dataclass
class Block:
    """Projections joined by non-stream edges, and how the block is planned."""

    members: tuple[str, ...]
    consumers: tuple[str, ...]
    producers: tuple[str, ...]
    norms: tuple[str, ...] = ()  # vector-only modules inside (per-head norms, learned activations)
    norm_inputs: dict[str, tuple[str, ...]] = field(default_factory=dict)  # norm -> the members feeding it
    mode: str = GATHERED_MODE
    # member -> packed parts (split mode), or the widths of unequal packed blocks its parent splits
    layouts: dict[str, int | tuple[int, ...]] = field(default_factory=dict)
    why: str = ""
    heads: "HeadSplit | None" = None  # split mode on its parent's heads (a gated delta-net)

    @property
    def whole(self) -> bool:
        """Left whole: every member replicated (matrices the roles do not lay out)."""
        return self.mode == WHOLE_MODE

    def roles(self) -> dict[str, str]:
        """The role of every member and norm in this block's mode."""
        if self.whole:
            return {name: "replicate" for name in (*self.members, *self.norms)}
        roles = {}
        for name in self.members:
            if name in self.consumers:
                roles[name] = "rowwise" if self.mode == SPLIT_MODE else "rowwise_split_input"
            elif self.mode == SPLIT_MODE:
                parts = self.layouts[name]
                roles[name] = COLWISE_BY_PARENT_ROLE if isinstance(parts, tuple) else _SPLIT_ROLE_BY_PARTS[parts]
            else:
                roles[name] = "colwise_gathered"
        for name in self.norms:
            roles[name] = "head_norm" if self.mode == SPLIT_MODE else "replicate"
        if self.heads is not None and self.mode == SPLIT_MODE:
            roles[self.heads.name] = HEAD_SPLIT_ROLE
            roles.update({owner: PLACED_BY_PARENT_ROLE for owner in self.heads.owners() if owner not in self.members})
        return roles


@dataclass
class HeadSplit:
    """The parent of a block's members whose own code runs the block on its heads (a gated
    delta-net: its projections feed a convolution and a recurrence over heads, with per-head
    vectors of its own), planned split on this rank's heads: its other parameters laid out
    as the heads they serve (``states``: name relative to it, a child's dotted -> placement
    on tp; ``slices``: replicated ones packing unequal blocks, ``local_views``), and the
    size attributes its code reshapes by (``sizes``) at this rank's share while it runs.
    All measured on the traced copy (``_head_split``), then checked by the dry run."""

    name: str
    states: dict[str, object]
    sizes: tuple[str, ...]
    slices: dict[str, tuple[int, tuple[str, ...]]]

    def owners(self) -> set[str]:
        """The children whose parameters the parent places: used by its own code, or
        members packing unequal blocks (``colwise_by_parent``)."""
        return {f"{self.name}.{param.rpartition('.')[0]}" for param in self.states if "." in param}


@dataclass
class Dataflow:
    """What one traced forward says about the model's modules (names of the traced copy)."""

    stream: frozenset[str]
    routers: frozenset[str]
    blocks: list[Block]
    standalone: frozenset[str]  # modules with matrices off any block (extra embeddings, gates, DBRX experts): replicated
    attention_inputs: frozenset[str] = frozenset()  # modules whose output reaches an attention's q, k or v
    # Modules (not leaves) whose output carries values from modules outside them: a block
    # that adds the residual stream to its own result (Bloom's attention takes ``residual``).
    outside_sums: frozenset[str] = frozenset()
    # Modules (not leaves) whose first output has fewer dims than the stream (Llama 4's MoE
    # returns its tokens flattened to [tokens, hidden]): no sequence dim to split it along.
    flat_outputs: frozenset[str] = frozenset()
    # Leaves whose first input has fewer dims than the stream (OPT's fc1/fc2 read [tokens, hidden]).
    flat_inputs: frozenset[str] = frozenset()
    # Leaves off the decoder layers that read what the layers wrote (OPT's project_out after
    # the final norm): under a sequence split they see each rank's piece of the sequence.
    after_layers: frozenset[str] = frozenset()
    # Leaves off the decoder layers (the head included) reading the layers' output itself, not
    # through another module off them (the final norm; the head where there is none).
    layer_readers: frozenset[str] = frozenset()
    # The sequence split dry run (``sequence_dry_run.py``), when the recipe splits the
    # sequence: why the model's code cannot run on a piece ("" when it can), and whether the
    # code after the layers needs the stream whole (GPT-2's final reshape to the full length).
    sequence_split_error: str = ""
    whole_after_layers: bool = False
    split_layer_inputs: tuple[int, ...] = ()  # the layers' other per-token inputs cut to the piece
    # (reader, source) name patterns (indices as *): a leaf whose input carries a leaf's
    # output (AXK1's post_mlp_layernorm reads the experts' and the shared expert's sum).
    reads: frozenset[tuple[str, str]] = frozenset()
    # Modules (not leaves) -> the positions, in their forward's signature, of the first input
    # carrying model values and of inputs carrying it again (CTRL's attention: v, k, q); for
    # a module in outside_sums, of every input shaped like it (Bloom's ``residual``).
    value_inputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Modules (not leaves) -> the positions of their outputs shaped like the first float one
    # (DBRX's norm_attn_norm hands on the stream and its norm): each carries the stream.
    value_outputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Modules handing out a parameter of their own other than as it is to their caller's own
    # code (a view of it, inside a nested output, or into another module) -> how: under a
    # sequence split its gradient cannot be placed (``_HandOuts``).
    misplaced_hand_outs: dict[str, str] = field(default_factory=dict)
    # Leaves whose parameters the model's code used outside their forward (DBRX's experts
    # slice their GLU's matrices; Gemma 3n's layer reads AltUp's coefficients).
    read_outside: frozenset[str] = frozenset()
    # Leaves off the decoder layers reading what they wrote and also called again elsewhere
    # (a final norm applied to the embeddings too): one call on the sequence piece, another
    # on the whole sequence, whose gradients no single placement describes.
    after_layers_called_again: frozenset[str] = frozenset()
    # Every module of the traced copy -> its class name: a head split's stand-in is one of the
    # same class (a hybrid's ``mixer`` is a recurrent layer in one layer, attention in the next).
    classes: dict[str, str] = field(default_factory=dict)
    # Under cp, the blocks cp would gather (for what they read outside their modules, or as
    # attention by their names) whose state the tiny copy handed on exactly from piece to
    # piece (``state_handoff.py``), and the others with why not: those stay gathered.
    state_handoff: frozenset[str] = frozenset()
    handoff_refusals: dict[str, str] = field(default_factory=dict)
    # Under cp, the attention blocks whose dry run on each rank's tokens failed, with why
    # (``token_attention_dry_run.py``): allgather_kv / ulysses cannot keep their tokens split.
    token_attention_refusals: dict[str, str] = field(default_factory=dict)

    def roles(self) -> dict[str, str]:
        roles = {name: "replicate" for name in self.standalone | self.routers}
        for block in self.blocks:
            roles.update(block.roles())
        return roles

    def same_class(self, traced: str, module: nn.Module) -> bool:
        """Whether the traced module ``traced`` is of ``module``'s class (unknown: assumed)."""
        return self.classes.get(traced, type(module).__name__) == type(module).__name__

    def block_of(self, name: str) -> Block | None:
        return next((block for block in self.blocks if name in block.members or name in block.norms), None)


class _Tags(TorchFunctionMode):
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
class _Trace:
    model: nn.Module
    mode: _Tags
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


def _own_params(module: nn.Module) -> list[torch.Tensor]:
    return list(module.parameters(recurse=False))


def _is_norm(module: nn.Module) -> bool:
    params = _own_params(module)
    return bool(params) and all(p.dim() < 2 for p in params)


def _leaves(model: nn.Module) -> dict[str, nn.Module]:
    """Modules with their own parameters and no parameterized children: what the tags name."""
    return {name: module for name, module in model.named_modules()
            if _own_params(module) and not any(_own_params(child) for child in module.modules() if child is not module)}


def _first_float(value) -> torch.Tensor | None:
    return next((t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


class _HandOuts:
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


def _trace(model: nn.Module, input_ids: torch.Tensor) -> _Trace:
    mode = _Tags()
    hand_outs = _HandOuts(model)
    leaves = _leaves(model)
    holders = {name: module for name, module in model.named_modules() if _own_params(module)}
    mode.owners = {id(param): name for name, module in holders.items() for param in _own_params(module)}
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
    return _Trace(model, mode, inputs, first_input, first_output, leaves, mode.of(logits), outputs, output_dims,
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
                     mode: "_Tags") -> tuple[tuple[int, ...], tuple[int, ...]]:
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


class _Resolver:
    """Tags -> the modules, attention calls and inputs they come from, through norms."""

    def __init__(self, trace: _Trace):
        self.trace = trace
        self.norms = {name for name, module in trace.leaves.items() if _is_norm(module)}

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


def analyze(model: nn.Module, input_ids: torch.Tensor, *, tp: int,
            dry_run: Callable[[nn.Module, dict[str, int], Block], str | None] | None = None,
            sequence_split: str | None = None) -> Dataflow:
    """Trace ``model`` (a tiny real instance) on ``input_ids`` and plan its blocks for ``tp``;
    with ``sequence_split`` ("sp": sequence parallel alone, "cp": context parallel), also
    dry-run the split of the stream along the sequence (``sequence_dry_run.py``)."""
    # Training mode: the plan is for training, and some code paths exist only there (Gemma 3n
    # clamps AltUp's coefficients and multiplies by them itself). The copy has no dropout.
    model.train(True)
    trace = _trace(model, input_ids)
    resolve = _Resolver(trace)
    head = output_embeddings(model)
    names = {id(module): name for name, module in model.named_modules()}
    head_name = names.get(id(head))
    embed_name = names.get(id(input_embeddings(model)))
    stream_tags = resolve(trace.inputs[head_name] if head_name in trace.inputs else trace.logits_tags)
    # The decoder layers' outputs are the stream too: the head may read it through a
    # projection (OPT's project_out), which would otherwise be all the stream there is.
    layers = decoder_layers(model)
    for index in range(len(layers[1]) if layers else 0):
        stream_tags = stream_tags | resolve(trace.outputs.get(f"{layers[0]}.{index}", frozenset()))
    stream = frozenset(tag[1] for tag in stream_tags if tag[0] == "mod")
    routers = frozenset(name for name in (
        {tag[1] for tag in resolve(trace.mode.selected) if tag[0] == "mod"} | trace.mode.selecting)
        if isinstance(trace.leaves.get(name), nn.Linear))  # other selecting modules (experts) are the planner's
    matrices = [name for name, module in trace.leaves.items()
                if not _is_norm(module) and name not in (head_name, embed_name) and name not in routers]
    # A block whose member's parameters the model's code uses outside the member (a module
    # handing its weight to a matmul of its parent) is not split: a split weight would be a
    # DTensor there, among plain tensors. Its members stay off blocks: replicated, plain.
    blocks = [block for block in _blocks(trace, resolve, matrices, stream)
              if not set(block.members) & trace.mode.read_outside]
    _plan_blocks(trace, blocks, tp, dry_run)
    in_blocks = {name for block in blocks for name in block.members}
    # Off every block: joined to no other projection except through the stream, so it reads
    # full values and its output is whole on every rank when replicated (DBRX's expert GLU,
    # a module of three matrices the experts' loop slices, is one).
    # Only what ran, or whose parameters the model's code used itself (Gemma 3n's correction
    # coefficients): a module the forward never touched says nothing here; names decide it.
    used = set(trace.inputs) | trace.mode.read_outside
    standalone = frozenset(name for name in matrices if name not in in_blocks and name in used)
    standalone |= _replicable_containers(model, trace, blocks)
    attention_inputs = frozenset(tag[1] for operands in trace.mode.attention
                                 for tag in resolve(frozenset().union(*operands)) if tag[0] == "mod")
    outside_sums = frozenset(
        name for name, tags in trace.outputs.items()
        if any(tag[0] == "mod" and not tag[1].startswith(name + ".") for tag in resolve(tags)))
    head_input = trace.first_input.get(head_name)
    stream_dims = head_input.dim() if head_input is not None else 3  # [batch, sequence, hidden]
    flat_outputs = frozenset(name for name, dims in trace.output_dims.items() if dims < stream_dims)
    flat_inputs = frozenset(name for name, value in trace.first_input.items() if value.dim() < stream_dims)
    inside = (lambda name: bool(layers) and name.startswith(layers[0] + "."))
    layer_readers = _downstream(trace, resolve, inside, frozenset(), transitive=False)
    after_layers = _downstream(trace, resolve, inside, frozenset({head_name}), transitive=True)
    flow = Dataflow(stream=stream, routers=routers, blocks=blocks, standalone=standalone,
                    attention_inputs=attention_inputs, outside_sums=outside_sums, flat_outputs=flat_outputs,
                    flat_inputs=flat_inputs, after_layers=after_layers, layer_readers=layer_readers,
                    # a block adding the stream to its output itself takes it as an input of its own
                    value_inputs={name: trace.stream_inputs[name] if name in outside_sums else positions
                                  for name, positions in trace.value_inputs.items()},
                    value_outputs=trace.value_outputs, misplaced_hand_outs=trace.misplaced_hand_outs,
                    read_outside=frozenset(trace.mode.read_outside),
                    after_layers_called_again=after_layers & trace.called_again,
                    classes={name: type(module).__name__ for name, module in model.named_modules()},
                    reads=frozenset((pattern(name), pattern(tag[1])) for name, tags in trace.inputs.items()
                                    for tag in tags if tag[0] == "mod" and tag[1] != name))
    if sequence_split is not None:
        verdict = check_sequence_split(model, input_ids, flow, cp=sequence_split == "cp")
        flow.sequence_split_error, flow.whole_after_layers = verdict.error, verdict.whole_after_layers
        flow.split_layer_inputs = verdict.split_layer_inputs
    if sequence_split == "cp":
        # the blocks cp would gather: those reading parameters outside their modules, and
        # attention by its names (a linear attention has q/k/v projections too); softmax
        # attention fails the check (it asks its cache for keys, not a state)
        candidates = recurrent_candidates(model, lambda fqn, child: any(True for _ in child.parameters()) and (
            whole_over_cp(fqn, child, flow.read_outside) or is_attention(fqn, child, {}, flow.attention_inputs)))
        flow.state_handoff, flow.handoff_refusals = handoff_blocks(model, input_ids, candidates, flow.value_inputs)
        attention = recurrent_candidates(model, lambda fqn, child: any(True for _ in child.parameters()) and (
            not whole_over_cp(fqn, child, flow.read_outside)) and is_attention(fqn, child, {}, flow.attention_inputs))
        flow.token_attention_refusals = token_attention_refusals(model, input_ids, attention, flow.value_inputs)
    return flow


def _downstream(trace: _Trace, resolve: "_Resolver", inside: Callable[[str], bool], skip: frozenset,
                transitive: bool) -> frozenset[str]:
    """Leaves off the decoder layers (but ``skip``) reading what the layers wrote: directly,
    or with ``transitive`` also through other such leaves (HY-V4's final norm reads its
    hyper-connection head, which reads the layers)."""
    found: set[str] = set()
    while True:
        more = {name for name in trace.leaves
                if name not in found and name not in skip and not inside(name) and name in trace.inputs
                and any(tag[0] == "mod" and (inside(tag[1]) or tag[1] in found)
                        for tag in resolve(trace.inputs[name], through_norms=False))}
        found |= more
        if not more or not transitive:
            return frozenset(found)


def _replicable_containers(model: nn.Module, trace: _Trace, blocks: list[Block]) -> frozenset[str]:
    """Modules with parameters of their own and parameterized children (DeepSeek-V4's
    compressor: a position bias beside its projections) that returned values, holding no
    member of a split block: what they compute from their own parameters is whole on every
    rank. (One returning only integers, an indexer's top-k, is left to the names.)"""
    split = [name for block in blocks if block.mode == SPLIT_MODE for name in (*block.members, *block.norms)]
    return frozenset(name for name, module in model.named_modules()
                     if name and name not in trace.leaves and name in trace.outputs and _own_params(module)
                     and not any(member.startswith(name + ".") for member in split))


def _blocks(trace: _Trace, resolve: _Resolver, matrices: list[str], stream: frozenset[str]) -> list[Block]:
    """Union the matrices over edges that do not go through the stream (module docstring)."""
    parent: dict = {}

    def find(node):
        parent.setdefault(node, node)
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    def union(a, b):
        parent[find(a)] = find(b)

    inner_of: dict[str, frozenset] = {}
    for name in matrices:
        sources = resolve(trace.inputs.get(name, ()))
        inner = frozenset(tag for tag in sources if not (tag[0] == "mod" and tag[1] in stream) and tag[0] != "input")
        inner_of[name] = inner
        find(("mod", name))
        for tag in inner:
            if tag[0] == "attn" or tag[1] in matrices:
                union(("mod", name), tag)
    for index, operands in enumerate(trace.mode.attention):
        for tag in resolve(frozenset().union(*operands)):
            if tag[0] == "mod" and tag[1] in matrices:
                union(("attn", index), tag)
    groups: dict = {}
    for name in matrices:
        groups.setdefault(find(("mod", name)), []).append(name)
    attentions: dict = {}
    for index in range(len(trace.mode.attention)):
        attentions.setdefault(find(("attn", index)), set()).add(("attn", index))
    blocks = []
    for root, members in groups.items():
        member_set = set(members)

        def fed_inside(name):
            return any(tag[0] == "attn" or tag[0] == "mod" and tag[1] in member_set for tag in inner_of[name])

        consumers = tuple(name for name in members if name in stream and fed_inside(name))
        producers = tuple(name for name in members if not fed_inside(name))
        if len(members) < 2 or not consumers:
            continue
        if not all(isinstance(trace.leaves[m], nn.Linear) for m in members):
            # the roles lay out nn.Linear weights ([out, in]): a block holding other matrices
            # (Inkling-2's short convolutions on k and v) is left whole, not split by names
            blocks.append(Block(members=tuple(members), consumers=consumers, producers=producers, mode=WHOLE_MODE,
                                why="holds matrices other than nn.Linear, which the roles do not lay out"))
            continue
        # Vector modules inside: fed by non-consumer members or the block's attention (a
        # norm on a consumer's output, a post-norm, is on the stream).
        inside = {("mod", name) for name in member_set - set(consumers)} | attentions.get(root, set())
        norms = tuple(sorted(name for name in resolve.norms if _inside(resolve(trace.inputs.get(name, ())), inside)))
        fed_by = {name: tuple(sorted(tag[1] for tag in resolve(trace.inputs[name]) if tag[0] == "mod"))
                  for name in norms}
        blocks.append(Block(members=tuple(members), consumers=consumers, producers=producers, norms=norms,
                            norm_inputs=fed_by))
    return blocks


def _inside(sources: frozenset, inside: set) -> bool:
    """Sources that are all inside one block (a norm inside it)."""
    return bool(sources) and sources <= inside


def _plan_blocks(trace: _Trace, blocks: list[Block], tp: int, dry_run) -> None:
    """Plan one block per shape (its members' names with indices as ``*``: every layer's
    attention, every expert's MLP) and give the others of that shape the same plan. The
    representative is the first whose consumer saw tokens (an expert no token was routed
    to in the traced forward says nothing)."""
    by_shape: dict[tuple, list[Block]] = {}
    for block in blocks:
        if block.mode == WHOLE_MODE:
            continue  # not split at all: nothing to measure
        by_shape.setdefault(tuple(sorted(pattern(name) for name in block.members)), []).append(block)
    for same in by_shape.values():
        seen = [b for b in same if _saw_tokens(trace, b)]
        if not seen:
            for block in same:
                block.why = "no token reached it in the traced forward"
            continue
        first = seen[0]
        _plan_block(trace, first, tp, dry_run)
        for block in same:
            if block is first:
                continue
            # members come in module order, so the i-th member of each block of a shape is the same one
            block.mode, block.why = first.mode, first.why
            block.layouts = {name: first.layouts[mine] for name, mine in zip(block.members, first.members)
                             if mine in first.layouts}
            if first.heads is not None:
                block.heads = replace(first.heads, name=block.members[0].rpartition(".")[0])


def _saw_tokens(trace: _Trace, block: Block) -> bool:
    x = trace.first_input.get(block.consumers[0])
    return x is not None and x.numel() > 0


def _plan_block(trace: _Trace, block: Block, tp: int, dry_run) -> None:
    """Split mode when every member's output features have one owning rank in a layout the
    roles have and the dry run passes; gathered otherwise, with the reason."""
    if tp <= 1:
        block.mode, block.why = SPLIT_MODE, "tp 1"
        block.layouts = {name: 1 for name in block.members}
        return
    if len(block.consumers) != 1:
        block.why = f"{len(block.consumers)} members write to the residual stream"
        return
    consumer = block.consumers[0]
    owners, why = _owners(trace, consumer, [m for m in block.members if m != consumer], tp)
    if owners is None:
        block.why = why
        return
    layouts: dict[str, int | tuple[int, ...]] = {}
    for name, owner in owners.items():
        parts = _layout(owner, tp) or tuple(_rank_blocks(owner, tp))
        if not parts:
            block.why = f"{name}'s output features are not split over tp as whole parts (e.g. q/k/v of unequal width)"
            return
        layouts[name] = parts
    layouts[consumer] = 1
    if dry_run is not None:
        # packed blocks of unequal widths ([q | k | v] of a gated delta-net) have no role of
        # their own: only their parent, run on its heads, hands them this rank's rows
        unequal = [name for name, parts in layouts.items() if isinstance(parts, tuple)]
        failure = (f"{unequal[0]} packs output blocks of unequal widths {list(layouts[unequal[0]])}" if unequal
                   else dry_run(trace.model, layouts, block))
        if failure:
            block.heads, why = _head_split(trace, block, tp, layouts)
            retry = dry_run(trace.model, layouts, block) if block.heads is not None else why
            if retry:
                block.heads = None
                block.why = f"the model's code does not run on one rank's share of the block: {failure}"
                block.why += f"; on its parent's heads: {retry}" if retry != failure else ""
                return
    elif any(isinstance(parts, tuple) for parts in layouts.values()):
        block.why = "a member packs output blocks of unequal widths and there is no dry run to plan its parent"
        return
    block.mode, block.layouts = SPLIT_MODE, layouts


def _owners(trace: _Trace, consumer: str, members: list[str], tp: int):
    """Per member, the tp rank that needs each of its output features (-1: none), from the
    gradient of each rank's slice of the consumer's input; None where a feature is needed
    by two ranks, with the reason."""
    outputs = [trace.first_output.get(name) for name in members]
    if any(out is None or not out.requires_grad for out in outputs):
        return None, "the traced forward did not record the block's tensors"
    needs, why = _rank_needs(trace, consumer, outputs, tp)
    if needs is None:
        return None, why
    owners = {}
    for name, need in zip(members, needs):
        need = need.reshape(tp, -1, need.shape[-1]).any(1)
        shared = (need.sum(0) > 1).nonzero()
        if len(shared):
            feature = int(shared[0])
            return None, (f"{name}'s output feature {feature} feeds the share of more than one tp rank "
                          "(e.g. a norm over the whole projection, a tensor shared by every head)")
        owners[name] = _owner_list(need)
    return owners, ""


def _owner_list(need: torch.Tensor) -> list[int]:
    """[tp, features] needs -> the owning rank of each feature (-1: none needs it)."""
    return torch.where(need.any(0), need.float().argmax(0), torch.full_like(need[0], -1, dtype=torch.long)).tolist()


def _rank_needs(trace: _Trace, consumer: str, tensors: list[torch.Tensor], tp: int):
    """For every tensor, a [tp, *shape] mask of the elements each tp rank's slice of the
    consumer's input features depends on (its gradient there is not zero); None and the
    reason where the trace cannot say."""
    x = trace.first_input.get(consumer)
    if x is None or not x.requires_grad:
        return None, "the traced forward did not record the block's tensors"
    if not tensors:
        return [], ""
    width = x.shape[-1]
    if width % tp:
        return None, f"{consumer}'s input width {width} does not divide by tp={tp}"
    generator = torch.Generator().manual_seed(0)
    needs = [torch.zeros((tp, *t.shape), dtype=torch.bool) for t in tensors]
    step = width // tp
    for rank in range(tp):
        piece = x[..., rank * step:(rank + 1) * step]
        weights = torch.rand(piece.shape, generator=generator, dtype=piece.dtype) + 0.5
        grads = torch.autograd.grad((piece * weights).sum(), tensors, retain_graph=True, allow_unused=True)
        for index, grad in enumerate(grads):
            if grad is not None:
                needs[index][rank] = grad.detach() != 0
    return needs, ""


def _layout(owner: list[int], tp: int) -> int | None:
    """The number of equal packed parts (1, 2 or 3) whose contiguous split over tp gives
    ``owner``; None if none does. Features no rank needs fit any layout."""
    width = len(owner)
    for parts in _SPLIT_ROLE_BY_PARTS:
        if width % (parts * tp):
            continue
        piece = width // (parts * tp)
        if all(rank < 0 or rank == (feature % (width // parts)) // piece for feature, rank in enumerate(owner)):
            return parts
    return None


def _head_split(trace: _Trace, block: Block, tp: int,
                layouts: dict[str, int | tuple[int, ...]]) -> tuple[HeadSplit | None, str]:
    """The block's parent planned on this rank's heads (``HeadSplit``), or None and why not.
    Its parameters outside the members are laid out by the heads that need them (measured
    as the members' are: which of their elements each rank's share of the consumer's input
    depends on; a norm every rank needs whole stays the block's head norm), and its size
    attributes are those of the same class built for one rank's share (``_share_module``)."""
    parents = {name.rpartition(".")[0] for name in block.members}
    if len(parents) != 1 or not next(iter(parents)):
        return None, "its members are not the children of one module"
    parent = parents.pop()
    module = trace.model.get_submodule(parent)
    extras = {name: param for name, param in module.named_parameters()
              if f"{parent}.{name}".rpartition(".")[0] not in block.members}
    ran = [name for name in extras if "." in name and f"{parent}.{name.rpartition('.')[0]}" in trace.inputs
           and f"{parent}.{name.rpartition('.')[0]}" not in block.norms]
    if ran:
        return None, f"{parent}.{ran[0]} belongs to a module of its own that is not in the block"
    needs, why = _rank_needs(trace, block.consumers[0], list(extras.values()), tp)
    if needs is None:
        return None, why
    placed: dict[str, object] = {}  # parameter (relative) -> Shard dim | (dim, block sizes) | Replicate()
    for (name, param), need in zip(extras.items(), needs):
        layout = _param_layout(need, tp)
        if layout is None:
            return None, f"{parent}.{name} is needed by the heads of more than one tp rank in no layout of whole heads"
        if not (isinstance(layout, Replicate) and f"{parent}.{name}".rpartition(".")[0] in block.norms):
            placed[name] = layout
    for member, parts in layouts.items():  # unequal packed blocks: their rows, handed over by the parent
        if isinstance(parts, tuple):
            for leaf, _ in trace.model.get_submodule(member).named_parameters(recurse=False):
                placed[f"{member[len(parent) + 1:]}.{leaf}"] = (0, list(parts))
    expected = _share_shapes(module, parent, block, layouts, placed, tp)
    share, sizes, why = _share_module(module, getattr(trace.model, "config", None), tp, expected)
    if share is None:
        return None, why
    states, slices = {}, {}
    for name, layout in placed.items():
        if isinstance(layout, int):
            states[name] = Shard(layout)
        elif isinstance(layout, tuple):
            dim, blocks = layout
            named = _block_names(module, share, blocks, tp)
            if named is None:
                return None, f"{parent}.{name} packs blocks {blocks} along dim {dim} that no size attribute of it names"
            states[name], slices[name] = Replicate(), (dim, named)
        else:
            states[name] = Replicate()
    return HeadSplit(parent, states, sizes, slices), ""


def _share_shapes(module: nn.Module, parent: str, block: Block, layouts: dict, placed: dict,
                  tp: int) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape on one rank's share: the members' rows (the consumer's
    columns) and the placed parameters' split dim divided by tp, the rest whole."""
    shapes = {}
    for name, param in module.named_parameters():
        shape, owner = list(param.shape), f"{parent}.{name}".rpartition(".")[0]
        leaf = name.rpartition(".")[2]
        if owner in block.consumers:
            if leaf != "bias":
                shape[-1] //= tp
        elif owner in layouts or name in placed and not isinstance(placed[name], Replicate):
            layout = placed.get(name, 0)
            dim = layout if isinstance(layout, int) else layout[0]
            shape[dim] //= tp
        shapes[name] = tuple(shape)
    return shapes


# Config keys the share search never divides: the model's widths outside the heads.
_WHOLE_KEYS = re.compile(r"hidden_size|vocab|layers|position|window|chunk|kernel|_dim$|state_size|experts")


def _share_module(module: nn.Module, config, tp: int, expected: dict[str, tuple[int, ...]]):
    """The same class built (on the meta device) for one rank's share: from the config with
    its head and group counts divided by tp, and, where its parameters do not yet have the
    shapes the measured layouts give one rank (``expected``), as few other counts divided
    as that takes (Mamba2's ``expand``). Returns (the share, the module's integer attributes
    it has divided by tp, ""), or (None, (), why)."""
    if config is None:
        return None, (), "the model has no config to build one rank's share from"
    counts = [key for key, value in vars(config).items()
              if type(value) is int and value >= tp and value % tp == 0 and not _WHOLE_KEYS.search(key)]
    chosen = [key for key in counts if "heads" in key or "groups" in key]
    share, why = _rebuilt(module, config, chosen, tp)
    misses = _shape_misses(share, expected)
    while share is not None and misses:
        tries = [(key, *_rebuilt(module, config, chosen + [key], tp)) for key in counts if key not in chosen]
        scored = [(len(_shape_misses(built, expected)), key, built) for key, built, _ in tries if built is not None]
        if not scored or min(scored)[0] >= len(misses) or len(chosen) > 8:
            return None, (), (f"{type(module).__name__} built with {', '.join(chosen) or 'no count'} divided by "
                              f"tp={tp} does not have one rank's parameter shapes ({', '.join(misses[:3])})")
        count, key, share = min(scored, key=lambda item: item[0])
        chosen.append(key)
        misses = _shape_misses(share, expected)
    if share is None:
        return None, (), why
    sizes = tuple(name for name, value in vars(module).items()
                  if type(value) is int and type(getattr(share, name, None)) is int and value != getattr(share, name)
                  and getattr(share, name) * tp == value)
    if not sizes:
        return None, (), f"{type(module).__name__} has no size attribute that scales with its heads"
    return share, sizes, ""


def _rebuilt(module: nn.Module, config, keys: list[str], tp: int):
    """``type(module)`` built on the meta device from ``config`` with ``keys`` divided by tp."""
    reduced = copy.deepcopy(config)
    for key in keys:
        setattr(reduced, key, getattr(config, key) // tp)
    kwargs = {}
    for name, parameter in inspect.signature(type(module).__init__).parameters.items():
        if name == "self" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if name == "config":
            kwargs[name] = reduced
        elif name in ("layer_idx", "layer_id", "layer_number"):
            kwargs[name] = getattr(module, name, getattr(module, "layer_idx", 0))
        elif parameter.default is parameter.empty:
            return None, f"{type(module).__name__}({name}=...) cannot be rebuilt for one rank's heads"
    try:
        with torch.device("meta"):
            return type(module)(**kwargs), ""
    except Exception as exc:  # the model's own constructor: any error means no rebuilt share
        return None, f"{type(module).__name__} does not build for one rank's heads ({type(exc).__name__}: {exc})"


def _shape_misses(share: nn.Module | None, expected: dict[str, tuple[int, ...]]) -> list[str]:
    """The parameters whose shape in ``share`` is not the expected one (all, without a share)."""
    if share is None:
        return list(expected)
    built = {name: tuple(param.shape) for name, param in share.named_parameters()}
    return [name for name, shape in expected.items() if built.get(name) != shape]


def _param_layout(need: torch.Tensor, tp: int):
    """A parameter's layout from which of its elements each rank needs ([tp, *shape]):
    ``Shard`` dim (an int) where each rank needs a contiguous chunk along one dim,
    ``(dim, block sizes)`` where it needs a chunk of each of several unequal blocks,
    ``Replicate()`` where every rank needs all of it (or none any), None otherwise."""
    if bool(need.all()) or not bool(need.any()):
        return Replicate()
    for dim in range(need.dim() - 1):
        others = tuple(d + 1 for d in range(need.dim() - 1) if d != dim)
        along = need.any(others) if others else need
        shape = [tp] + [need.shape[d + 1] if d == dim else 1 for d in range(need.dim() - 1)]
        if not bool((need == along.reshape(shape)).all()) or bool((along.sum(0) > 1).any()):
            continue
        owner = _owner_list(along)
        if _layout(owner, tp) == 1:
            return dim
        blocks = _rank_blocks(owner, tp)
        if blocks:
            return dim, blocks
    return None


def _rank_blocks(owner: list[int], tp: int) -> list[int]:
    """The sizes of consecutive blocks each split over tp in rank order (equal pieces),
    that ``owner`` is; empty if it is not (or a feature no rank needs)."""
    blocks, start = [], 0
    while start < len(owner):
        run = 1
        while start + run < len(owner) and owner[start + run] == owner[start]:
            run += 1
        piece = owner[start:start + run * tp]
        if len(piece) < run * tp or piece != [rank for rank in range(tp) for _ in range(run)]:
            return []
        blocks.append(run * tp)
        start += run * tp
    return blocks


def _block_names(module: nn.Module, share: nn.Module, blocks: list[int], tp: int) -> tuple[str, ...] | None:
    """Each block size named by the module's integer attributes: one (``key_dim``) or a
    product of two (``n_groups*ssm_state_size``) whose value is the block's and, on one
    rank's share, the block's divided by tp; None where a block has no such name."""
    ints = {name: value for name, value in vars(module).items()
            if type(value) is int and type(getattr(share, name, None)) is int}
    names = [(name,) for name in ints] + [(a, b) for a in ints for b in ints if a < b]
    found = []
    for size in blocks:
        match = next(("*".join(parts) for parts in names
                      if math.prod(ints[p] for p in parts) == size
                      and math.prod(getattr(share, p) for p in parts) * tp == size), None)
        if match is None:
            return None
        found.append(match)
    return tuple(found)


def _head_split_hooks(model: nn.Module, split: HeadSplit, tp: int, rank: int) -> list:
    """For the dry run: while the parent runs, its parameters and sizes are rank ``rank``'s
    share, as the applier gives them (``local_views``)."""
    module = model.get_submodule(split.name)
    saved: list[tuple[dict, dict]] = []

    def swap_in(mod, args):
        originals = {}
        for name, placement in split.states.items():
            owner, leaf = owner_of(mod, name)
            value = originals[name] = owner._parameters[leaf]
            if name in split.slices:
                dim, blocks = split.slices[name]
                local = packed_blocks_piece(value, dim, block_sizes(mod, blocks, split.name), tp, rank, split.name)
            else:
                local = local_piece(value, placement, tp, rank)
            owner._parameters[leaf] = local
        sizes = {name: getattr(mod, name) for name in split.sizes}
        for name, value in local_sizes(mod, split.sizes, tp, split.name).items():
            setattr(mod, name, value)
        saved.append((originals, sizes))

    def swap_out(mod, args, output):
        originals, sizes = saved.pop()
        for name, value in originals.items():
            owner, leaf = owner_of(mod, name)
            owner._parameters[leaf] = value
        for name, value in sizes.items():
            setattr(mod, name, value)

    return [module.register_forward_pre_hook(swap_in), module.register_forward_hook(swap_out, always_call=True)]


def local_widths_dry_run(model: nn.Module, input_ids: torch.Tensor, tp: int) -> Callable:
    """A dry run for ``analyze``: for every tp rank, each split member hands on that rank's
    rows (of each packed part), and the consumer's first input must then equal that rank's
    slice of its input in the unsplit model (it is padded back to full width to go on).
    The model's own code between them must run on the narrower tensors and compute the
    same values there (a reshape or an ALiBi table from the global head count fails one or
    the other). Returns the error text, or None."""

    def run(_model, layouts: dict[str, int], block: Block) -> str | None:
        modules = dict(model.named_modules())
        consumer = block.consumers[0]
        reference = _first_input(model, modules[consumer], input_ids)
        if reference is None or reference.shape[-1] % tp:
            return f"{consumer} received no input whose width divides by tp={tp}"
        width = reference.shape[-1] // tp
        for rank in range(tp):
            seen: dict[str, torch.Tensor] = {}
            handles = [modules[consumer].register_forward_pre_hook(_pad_input(tp, seen))]
            handles += [modules[name].register_forward_hook(_rank_rows(parts, tp, rank))
                        for name, parts in layouts.items()
                        if name not in block.consumers and not isinstance(parts, tuple)]
            if block.heads is not None:
                handles += _head_split_hooks(model, block.heads, tp, rank)
            try:
                with torch.no_grad():
                    model(input_ids=input_ids)
            except Exception as exc:  # the model's own code: any error means it does not run locally
                return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            finally:
                for handle in handles:
                    handle.remove()
            want = reference[..., rank * width:(rank + 1) * width]
            local = seen.get("input")
            if local is None or local.shape != want.shape or not torch.allclose(local, want, rtol=1e-4, atol=1e-5):
                return (f"on tp rank {rank}'s share, {consumer}'s input is not that rank's slice of the unsplit "
                        "model's (the code between computes something else on a share)")
        return None

    return run


def _first_input(model: nn.Module, module: nn.Module, input_ids: torch.Tensor) -> torch.Tensor | None:
    seen: dict[str, torch.Tensor] = {}
    handle = module.register_forward_pre_hook(_pad_input(1, seen))
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        handle.remove()
    return seen.get("input")


def _rank_rows(parts: int, tp: int, rank: int):
    def hook(module, args, output):
        if not isinstance(output, torch.Tensor):
            return output
        size = output.shape[-1] // parts
        piece = size // tp
        return torch.cat([output[..., p * size + rank * piece:p * size + (rank + 1) * piece] for p in range(parts)],
                         dim=-1)
    return hook


def _pad_input(tp: int, seen: dict[str, torch.Tensor]):
    """Records the module's first input, and hands it on ``tp`` times as wide."""
    def hook(module, args):
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        local = args[0]
        seen.setdefault("input", local.detach().clone())
        return None if tp == 1 else (torch.cat([local] * tp, dim=-1), *args[1:])
    return hook


def pattern(name: str) -> str:
    """A module name with every index written ``*`` (layer and expert numbers)."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


class StandIns:
    """Which traced module(s) stand for each of the planned model's modules. The traced
    copy has the model's first layers (every layer kind) and maybe fewer experts: a name
    stands for itself if traced, else for the traced names equal to it but for the layer
    index (its first number), else for those equal but for every number (an expert beyond
    the copy's count). A Sequential's children (``ffn.0``, ``ffn.2``) stay apart."""

    def __init__(self, traced: Iterable[str]):
        self.exact = set(traced)
        self.by_layer: dict[str, list[str]] = {}
        self.by_all: dict[str, list[str]] = {}
        for name in sorted(self.exact):
            self.by_layer.setdefault(_layer_pattern(name), []).append(name)
            self.by_all.setdefault(pattern(name), []).append(name)

    def __call__(self, name: str) -> list[str]:
        if name in self.exact:
            return [name]
        return self.by_layer.get(_layer_pattern(name)) or self.by_all.get(pattern(name), [])


def _layer_pattern(name: str) -> str:
    """A module name with its first index (the layer number) written ``*``."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:index] + ["*"] + parts[index + 1:])
    return name


def roles_for(model: nn.Module, flow: Dataflow) -> dict[str, str]:
    """The dataflow roles by the planned model's module names (``StandIns``); a name whose
    stand-ins have more than one role gets none."""
    traced = flow.roles()
    stand_ins = StandIns(traced)
    roles = {}
    for name, module in model.named_modules():
        # a head split is its class's own code run on a share: never stood in for by another class
        found = {traced[other] for other in stand_ins(name)
                 if traced[other] not in _HEAD_ROLES or flow.same_class(other, module)}
        if len(found) == 1:
            roles[name] = found.pop()
    return roles
