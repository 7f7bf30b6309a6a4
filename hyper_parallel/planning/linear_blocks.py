"""Linear blocks of the traced forward, and whether each can be split over tp.

A **block** is a set of projections joined by edges that do not go through the residual
stream (q/k/v -> attention -> o; gate, up -> down; fc_in -> fc_out of one expert; MLA's
chains), with its **consumers** (the members that write to the stream), its
**producers** (the members that read it) and inner members (``find_blocks``, from the
tags of ``value_trace.py``).

Whether a block can be split over ``tp`` the Megatron way (producers colwise, consumer
rowwise) is measured, not assumed (``plan_blocks``): for every tp rank, the gradient of
that rank's slice of the consumer's input features with respect to every member's output
says which of the member's output features that rank needs. The block splits when each
feature is needed by at most one rank and the owners form a layout the roles have:
contiguous rows (``colwise``; per-head fused layouts such as Bloom's), or 2 or 3 equal
packed parts each split over tp (``fused_gate_up`` / ``fused_qkv``). A dry run
(``local_widths_dry_run.py``) then checks that the model's own code runs on those local
widths (a reshape with the global head count does not). A block that fails either check
is planned **gathered**: each member computes its rows and hands on all of them
(``colwise_gathered``), the consumer slices its input (``rowwise_split_input``): exact for
any dataflow, weights still split, the inner computation not. Fused projections whose
q/k/v parts differ in width (GQA) land here. A block whose members feed a parent that runs
them on its heads (a gated delta-net) may instead be split on that parent's heads
(``HeadSplit``, measured the same way).
"""

import copy
import inspect
import math
import re
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from hyper_parallel.planning.stand_ins import pattern
from hyper_parallel.planning.value_trace import TagResolver, TracedForward

SPLIT_MODE, GATHERED_MODE, WHOLE_MODE = "split", "gathered", "whole"
# Roles a block member can get, by the layout its rank owners form (parts split over tp).
_SPLIT_ROLE_BY_PARTS = {1: "colwise", 2: "fused_gate_up", 3: "fused_qkv"}
# The parent computing a block on its heads, and a child whose parameters it places (HeadSplit).
HEAD_SPLIT_ROLE, PLACED_BY_PARENT_ROLE, COLWISE_BY_PARENT_ROLE = "head_split", "placed_by_parent", "colwise_by_parent"
HEAD_ROLES = frozenset({HEAD_SPLIT_ROLE, PLACED_BY_PARENT_ROLE, COLWISE_BY_PARENT_ROLE})


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


def find_blocks(trace: TracedForward, resolve: TagResolver, matrices: list[str], stream: frozenset[str]) -> list[Block]:
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


def plan_blocks(trace: TracedForward, blocks: list[Block], tp: int, dry_run) -> None:
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


def _saw_tokens(trace: TracedForward, block: Block) -> bool:
    x = trace.first_input.get(block.consumers[0])
    return x is not None and x.numel() > 0


def _plan_block(trace: TracedForward, block: Block, tp: int, dry_run) -> None:
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


def _owners(trace: TracedForward, consumer: str, members: list[str], tp: int):
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


def _rank_needs(trace: TracedForward, consumer: str, tensors: list[torch.Tensor], tp: int):
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


def _head_split(trace: TracedForward, block: Block, tp: int,
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
