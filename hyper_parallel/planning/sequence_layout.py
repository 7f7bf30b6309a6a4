"""Sequence layouts on top of the tensor-parallel roles: SP, CP and loss parallel.

The tensor-parallel roles (``roles.py``) keep activations replicated between modules.
When the sequence is split (sequence parallel over ``tp``, context parallel over
``cp``), this pass rewrites the plan so that the *residual stream* is sharded on the
sequence dim (``R`` below) and only the blocks that need more see more:

| where                      | what the plan does                                                        |
|----------------------------|---------------------------------------------------------------------------|
| embedding                  | unchanged: full sequence on every rank (HF's model code derives position  |
|                            | ids and the causal mask from its output, so that must stay full)          |
|                            | (tied to the lm_head under cp: its entry also names cp, so the one weight |
|                            | sums the head's partial gradient over cp, ``_embedding_on_cp``)           |
| first decoder layer        | input ``replicate`` -> ``R``: each rank keeps its sequence piece          |
| norms (layers, final norm) | compute on their piece; weight grads are partial sums over the split axes |
| attention block            | input gathered (``R`` -> replicate): attention sees the full K/V with the |
|                            | full-length mask and positions; output partial(tp) -> ``R``               |
|                            | (reduce-scatter with SP, a slice over cp)                                  |
| MLP / MoE block            | input gathered over tp only (SP); tokens stay split over cp (per-token    |
|                            | work); output partial(tp) -> ``R``                                        |
| code after the layers      | per-token code runs on the piece; where it needs the whole sequence (the  |
| needing the whole sequence | split dry run, ``sequence_dry_run.py``: GPT-2 reshapes to the full length |
|                            | after its final norm), the modules reading the layers' output gather it   |
|                            | and the head takes its cp piece of the whole (a slice)                    |
| block adding the stream    | Bloom's attention and MLP take ``residual`` and add it themselves: that    |
| itself / handing on two    | input is gathered too, partial sums are reduced before the add and the    |
|                            | block hands on a slice (DBRX's norm_attn_norm: each stream output)         |
| block whose parameters the | under cp gathered like attention (DBRX's experts slice their GLU's         |
| model reads outside it     | matrices: plain tensors need whole-sequence gradients)                    |
| recurrent block (gated     | under cp its tokens stay split like an MLP's, and its state is handed from |
| delta-net, Mamba2 mixer)   | rank to rank through its cache protocol (``state_handoff.py``): role      |
|                            | ``state_handoff``, where the tiny copy's hand-off was exact and the cp    |
|                            | pieces are contiguous (no load balancing); else gathered like the above   |
| lm_head                    | input gathered over tp; logits stay split over cp (and over the vocab     |
|                            | with loss parallel) into the applier's sharded cross entropy — when the   |
|                            | model's forward computes its loss through ``self.loss_function``, which   |
|                            | the applier replaces; a model computing its loss inline gets its logits   |
|                            | gathered over cp, and loss parallel is refused for it                     |

Inside a block the TP roles stay as they are, except that the block's last
projections (rowwise, experts) hand on their partial sums and the block's output
boundary reduces them (one reduce-scatter instead of an all-reduce each). Not so in an
MoE block whose own code multiplies an expert output with a replicated gate other than
the router (Qwen2-MoE's ``sigmoid(shared_expert_gate(x)) * shared_out``): on a partial
``shared_out`` the gate's gradient would be a partial sum that nothing reduces, so there
the last projections reduce to replicate and the block's output is a slice. Inside an MLP block, the cp split of the tokens is written on
every entry so that replicated weights get their gradients summed over cp.

Attention under CP, as ``accelerator.context_parallel.algorithm`` says:

- ``gather_sequence``: the block gathers its input hidden states over cp and computes on
  the whole sequence on each cp rank (exact, but the attention work itself is not split);
- ``allgather_kv`` (``split_attention``): the block keeps the rank's tokens (role
  ``kv_gathered_attention``; its members' entries name the cp token split, like an MLP
  block's, so their replicated weights get gradients summed over cp); the applier's
  ``context_parallel`` module gathers K and V inside the attention function and slices
  the rotary position embeddings to the rank's tokens. Refused for a block whose code
  does not call transformers' attention interface (its attention could not see the
  gathered K/V) or that adds the stream itself;
- ``ulysses``: the same plan (role ``ulysses_attention``); the wrapper exchanges sequence
  and heads all-to-all around the inner attention instead (the planner checks that
  tp*cp divides the heads).
"""

from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.context_parallel import ATTENTION_NAMES, ATTENTION_ROLE, TOKEN_ATTENTION_ROLES
from hyper_parallel.distributed.model_parts import decoder_layers, input_embeddings, output_embeddings
from hyper_parallel.planning.plan_lint import PlanError
from hyper_parallel.planning.roles import replicate
from hyper_parallel.planning.sequence_dry_run import is_attention, whole_over_cp
from hyper_parallel.planning.stand_ins import pattern
from hyper_parallel.protocols.axes import CP, TP
from hyper_parallel.protocols.sharding import IO_PLACEMENT_FIELDS, ShardingConfig

# Roles that split a projection's weight over tp (whole elsewhere): what runs on a piece of
# the sequence says so in its IO placements.
_TP_SPLIT_ROLES = frozenset({"colwise", "colwise_gathered", "rowwise", "rowwise_split_input"})
_PARTIAL_OUTPUT_ROLES = frozenset({"rowwise", "rowwise_split_input", "packed_experts", "local_params_summed"})


@dataclass(frozen=True)
class TracedFacts:
    """What the dataflow trace saw, in the planned model's module names (the planner maps
    the traced copy's names onto them). Empty without a trace: names decide alone.

    - ``attention_inputs``: modules feeding an attention's q, k or v; a layer's child
      holding one is an attention block whatever its modules are called;
    - ``outside_sums``: modules whose output carries values from outside them (a block
      adding the residual itself, which ``value_inputs`` then lists among its inputs): a
      layer's block of that kind reduces its partial sums before adding it;
    - ``routers``: linears picking experts; a block holding one is an MoE block even when
      its experts are a ModuleList of linears rather than packed tensors;
    - ``flat_outputs`` / ``flat_inputs``: modules returning / leaves reading fewer dims than
      the stream (tokens flattened to [tokens, hidden]); sequence parallel refuses them;
    - ``after_layers``: leaves off the decoder layers reading what the layers wrote (OPT's
      project_out after the final norm): they compute on the split sequence;
    - ``token_attention_refusals``: (cp) attention blocks whose dry run on each rank's tokens
      failed, with why (``token_attention_dry_run``): they cannot keep their tokens split;
    - ``value_inputs``: module -> positions of its inputs carrying the stream; a block
      converts each (CTRL's attention takes it as v, k and q), by default its first input;
    - ``value_outputs``: module -> positions of its outputs carrying the stream; a block
      hands on each split (DBRX's norm_attn_norm returns the stream and its norm), whole
      before the split when there are several (no partial sum reaches two outputs);
    - ``reads``: (reader, source) name patterns (indices ``*``) of leaves whose input
      carries another leaf's output; a block whose module reads a partial sum of its own
      (AXK1's MoE ends in a norm of the experts' output) reduces it before handing it on;
    - ``layer_readers``: leaves off the layers reading the layers' output itself (the final
      norm; the head when there is none);
    - ``read_outside``: leaves whose parameters the model's code uses outside their forward;
      under cp a block holding one is gathered like attention (``whole_over_cp``);
    - ``after_layers_called_again``: modules after the layers also called elsewhere (a final
      norm applied to the embeddings too): one call on the piece, one on the whole sequence;
      refused;
    - ``misplaced_hand_outs``: modules handing out a parameter of their own other than as
      it is to the layer's code (a view, nested, or into another module): under a
      sequence split its gradient cannot be placed; such a module in a layer is refused;
    - ``state_handoff`` / ``handoff_refusals``: under cp, the blocks cp would gather (for
      ``read_outside``, or as attention by name) whose state the tiny copy handed on exactly
      from piece to piece
      (``state_handoff.py``): they run on the rank's piece with the state handed on; the
      others (with why) stay gathered;
    - ``split_error`` / ``whole_after_layers``: the sequence split dry run's verdict
      (``sequence_dry_run.py``): why the model's code cannot run on a piece of the
      sequence, or that the code after the layers needs the stream whole (GPT-2 reshapes
      to the full length after its final norm): the layer readers gather it.
    """

    attention_inputs: frozenset[str] = frozenset()
    outside_sums: frozenset[str] = frozenset()
    routers: frozenset[str] = frozenset()
    flat_outputs: frozenset[str] = frozenset()
    flat_inputs: frozenset[str] = frozenset()
    after_layers: frozenset[str] = frozenset()
    value_inputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    value_outputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    reads: frozenset[tuple[str, str]] = frozenset()
    layer_readers: frozenset[str] = frozenset()
    read_outside: frozenset[str] = frozenset()
    after_layers_called_again: frozenset[str] = frozenset()
    misplaced_hand_outs: dict[str, str] = field(default_factory=dict)
    state_handoff: frozenset[str] = frozenset()
    handoff_refusals: dict[str, str] = field(default_factory=dict)
    split_error: str = ""
    token_attention_refusals: dict[str, str] = field(default_factory=dict)
    whole_after_layers: bool = False
    split_layer_inputs: tuple[int, ...] = ()
    traced: bool = False  # the facts come from a trace (else every set is empty for want of one)


@dataclass(frozen=True)
class BlockStreams:
    """Where a layer's block takes and hands on the residual stream, as the trace saw it:
    ``inputs`` / ``outputs`` (positions; the first by default) and whether it adds the
    stream itself (Bloom's blocks add the residual; DBRX's hands on two streams)."""

    inputs: tuple[int, ...] = (0,)
    outputs: tuple[int, ...] = (0,)
    adds_stream: bool = False

    @classmethod
    def of(cls, fqn: str, traced: TracedFacts) -> "BlockStreams":
        """The block ``fqn``'s streams in ``traced``."""
        outputs = traced.value_outputs.get(fqn) or (0,)
        return cls(traced.value_inputs.get(fqn) or (0,), outputs, fqn in traced.outside_sums or len(outputs) > 1)

    @property
    def single(self) -> bool:
        """One stream in, one out, not added by the block itself."""
        return self.inputs == (0,) and self.outputs == (0,) and not self.adds_stream


ONE_STREAM = BlockStreams()


def apply_sequence_layout(model: nn.Module, modules: dict[str, ShardingConfig], roles: dict[str, str],
                          layout: Layout, traced: TracedFacts = TracedFacts()) -> dict[str, str]:
    """Rewrite ``modules``/``roles`` in place for ``layout``'s sequence layout (sp, cp and
    its attention algorithm, loss parallel), with what the dataflow trace saw (``traced``).
    Where the recipe left the cp algorithm to its default, an attention block that cannot
    keep its tokens gathers them instead of being refused. Returns those blocks, each with
    why."""
    gathered: dict[str, str] = {}
    cp = layout.cp > 1
    sharded_loss = loss_goes_through_loss_function(model)
    if layout.loss_parallel and not sharded_loss:
        raise PlanError(f"accelerator.loss_parallel: {type(model).__name__}.forward computes its loss itself, not "
                        f"through self.loss_function, so the logits cannot reach it sharded over the vocabulary; "
                        f"set loss_parallel: false")
    if cp or layout.sequence_parallel:
        _split_sequence(model, modules, roles, _SequenceSplit(layout, traced, gathered),
                        logits_split_over_cp=sharded_loss)
    if cp and _ties_embeddings(model):
        _embedding_on_cp(model, modules)
    if layout.loss_parallel:
        _keep_logits_vocab_sharded(modules, roles)
    return gathered


@dataclass
class _SequenceSplit:
    """One sequence split as the layer pass reads it: the layout, the trace's facts, the
    residual stream's placement and the whole one, and the attention blocks that gather
    their tokens (``gathered``, filled as the pass goes)."""

    layout: Layout
    traced: TracedFacts
    gathered: dict[str, str]

    @property
    def cp(self) -> bool:
        """Context parallel splits the sequence."""
        return self.layout.cp > 1

    @property
    def sp(self) -> bool:
        """Sequence parallel splits the sequence over tp."""
        return self.layout.sequence_parallel

    @property
    def residual(self) -> dict:
        """The residual stream's placement: split on the sequence over the split axes."""
        return residual_placement(cp=self.cp, sp=self.sp)

    @property
    def full(self) -> dict:
        """The whole sequence on every rank of the split axes."""
        return {**({CP: Replicate()} if self.cp else {}), TP: Replicate()}

    @property
    def split_attention(self) -> str:
        """The role of attention blocks keeping each cp rank's tokens (allgather_kv,
        ulysses); '' where they gather their input (gather_sequence, or no cp)."""
        return ATTENTION_ROLE.get(self.layout.context_parallel.algorithm, "") if self.cp else ""

    @property
    def hand_state_on(self) -> bool:
        """Recurrent blocks may hand their state from rank to rank: the cp pieces are
        contiguous (no load balancing)."""
        return not self.layout.context_parallel.load_balance


def _embedding_on_cp(model: nn.Module, modules: dict[str, ShardingConfig]) -> None:
    """Tied embeddings under cp: one weight, used by the embedding on the full sequence
    (its gradient complete on every cp rank) and by the lm_head on each rank's piece (a
    partial sum over cp). The applier puts a parameter on the mesh axes its first entry
    names, so the embedding's entry names cp too (every activation replicated over cp):
    the shared weight then lives on (cp, tp), and the lm_head's partial gradient is summed
    over cp when backward ends while the embedding's stays as it is."""
    names = {id(module): name for name, module in model.named_modules()}
    fqn = names.get(id(input_embeddings(model)))
    config = modules.get(fqn)
    if config is None:
        return
    full_over_cp = {CP: Replicate()}
    for key in IO_PLACEMENT_FIELDS:
        value = getattr(config, key)
        if value is not None:
            setattr(config, key, tuple(None if named is None else {**full_over_cp, **named} for named in value))
    config.state_shardings = {name: {**full_over_cp, **named} for name, named in config.state_shardings.items()}


def _ties_embeddings(model: nn.Module) -> bool:
    """The input embedding's weight is the output embedding's (tie_word_embeddings)."""
    inputs, outputs = input_embeddings(model), output_embeddings(model)
    weight = getattr(inputs, "weight", None)
    return weight is not None and weight is getattr(outputs, "weight", None)


def loss_goes_through_loss_function(model: nn.Module) -> bool:
    """Whether the model's forward hands its logits to ``self.loss_function`` (every HF
    causal LM does; the applier makes it sharding-aware) rather than computing the loss
    inline, where logits left split over the vocabulary or the sequence would meet full
    labels. Read from the source of the forward that runs; unreadable counts as inline."""
    import inspect

    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    return "self.loss_function(" in source


def residual_placement(*, cp: bool, sp: bool) -> dict:
    placement = {CP: Shard(1)} if cp else {}
    placement[TP] = Shard(1) if sp else Replicate()
    return placement


def _split_sequence(model, modules, roles, split: _SequenceSplit, *, logits_split_over_cp: bool) -> None:
    """The sequence split through the decoder layers: the first layer's entry splits the
    stream, every layer's children are placed on the piece, then what follows the layers."""
    found = decoder_layers(model)
    if found is None:
        raise PlanError(f"{type(model).__name__}: sequence/context parallel needs the decoder layers, "
                        "but the model has no nn.ModuleList of layers")
    layers_fqn, layers = found
    traced, residual, full = split.traced, split.residual, split.full
    # each layer by its own name (a view of some layers holds them under their own indices)
    named = [(f"{layers_fqn}.{index}", layer) for index, layer in layers.named_children()]
    first = named[0][0]
    # A decoder layer's own parameters (Doge's residual scales) act on its sequence piece:
    # the first layer's entry splits the sequence and keeps them, the others' read the piece.
    modules[first] = ShardingConfig(**_own_layout(modules, first), in_src=(full,), in_dst=(residual,),
                                    local_map=True)
    roles[first] = "sequence_split"
    for fqn, _ in named[1:]:
        if fqn in modules:
            _residual_module(modules[fqn], residual)
    for fqn, _ in named if traced.split_layer_inputs else ():
        _split_layer_inputs(modules, roles, fqn, traced.split_layer_inputs, residual, full)
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    for layer_fqn, layer in named:
        for name, child in layer.named_children():
            if _has_params(child):
                _place_layer_child(f"{layer_fqn}.{name}", child, modules, roles, split, implementation)
    _refuse_unsplittable(model, layers_fqn, split)
    _place_after_layers(model, modules, roles, layers_fqn, split, logits_split_over_cp=logits_split_over_cp)


def _place_layer_child(fqn: str, child: nn.Module, modules, roles, split: _SequenceSplit,
                       implementation: str | None) -> None:
    """One child of a decoder layer on the split sequence, by what it is: a flat member, a
    recurrent block handing its state on, an attention block (keeping its tokens or
    gathering them), a block gathered for its parameters read outside it, a norm, or an
    MLP/MoE block."""
    traced = split.traced
    if split.sp and fqn in traced.flat_outputs:
        # sequence parallel hands each block's output on split along the sequence dim,
        # which a [tokens, hidden] output does not have (its dim 1 is the hidden one)
        raise PlanError(
            f"accelerator.sequence_parallel: {fqn} ({type(child).__name__}) returns its tokens "
            "flattened ([tokens, hidden], no sequence dim), and sequence parallel splits each block's "
            "output along the sequence dim; it cannot do such a block yet: set sequence_parallel: false")
    streams = BlockStreams.of(fqn, traced)
    attention = is_attention(fqn, child, roles, traced.attention_inputs)
    if _is_flat_member(fqn, child, roles):
        _flat_member(fqn, modules, roles, split)
    elif split.cp and split.hand_state_on and fqn in traced.state_handoff:
        # measured on the trace, before the names: a linear attention's q/k/v
        # projections or a head-split layer's per-head norm read as attention's
        _handoff_block(fqn, child, modules, roles, split, streams)
    elif attention and split.split_attention and _keeps_tokens(fqn, child, split, implementation, streams):
        _attention_block(fqn, child, modules, roles, split, ONE_STREAM, role=split.split_attention)
    elif attention:
        _attention_block(fqn, child, modules, roles, split, streams)
    elif split.cp and whole_over_cp(fqn, child, traced.read_outside):
        _attention_block(fqn, child, modules, roles, split, streams, role="gathered_block")
    elif roles.get(fqn) == "replicate" and not any(_has_params(c) for c in child.children()):
        _residual_module(modules[fqn], split.residual)  # a norm of the layer; not a block with own vectors
    else:
        _mlp_block(fqn, child, modules, roles, split, streams)


def _refuse_unsplittable(model: nn.Module, layers_fqn: str, split: _SequenceSplit) -> None:
    """What the trace found no placement for on a split sequence: a layer's parameter
    handed out other than as it is, a module after the layers called again on the whole
    sequence, or a model whose code failed the split dry run."""
    traced = split.traced
    key, fix = ("cp_size", "cp_size: 1") if split.cp else ("sequence_parallel", "sequence_parallel: false")
    for fqn, how in sorted(traced.misplaced_hand_outs.items()):
        if fqn.startswith(layers_fqn + "."):
            raise PlanError(f"accelerator.{key}: {fqn} ({type(model.get_submodule(fqn)).__name__}) {how}; split along "
                            "the sequence, its gradient is placed only for a parameter handed out as it is to the "
                            f"decoder layer's own code: set {fix}")
    for fqn in sorted(traced.after_layers_called_again):
        raise PlanError(f"accelerator.{key}: {fqn} ({type(model.get_submodule(fqn)).__name__}) reads what the "
                        "decoder layers wrote, on each rank's piece of the sequence, and is called again elsewhere in "
                        f"the forward (on the whole sequence), so no one placement gives its gradients: set {fix}")
    if traced.split_error:
        raise PlanError(f"accelerator.{key}: a dry run of the split on a tiny copy of {type(model).__name__} failed: "
                        f"{traced.split_error}; sequence and context parallel cannot do such a model yet: set {fix}")


def _place_after_layers(model: nn.Module, modules, roles, layers_fqn: str, split: _SequenceSplit, *,
                        logits_split_over_cp: bool) -> None:
    """The modules after the layers on the split stream (the final norm, OPT's project_out,
    the lm_head): on the rank's piece, or gathering it where the code after the layers
    needs the whole sequence (``whole_after_layers``)."""
    cp, traced, residual = split.cp, split.traced, split.residual
    whole = traced.whole_after_layers
    for fqn in sorted(traced.after_layers):  # outside the layers on the split stream, but unplanned
        if fqn not in modules and not fqn.startswith(layers_fqn + "."):
            modules[fqn], roles[fqn] = replicate(model.get_submodule(fqn), {}), "replicate"
    for fqn, role in list(roles.items()):
        inside_layers = fqn == layers_fqn or fqn.startswith(layers_fqn + ".")
        on_split_stream = fqn in traced.after_layers if traced.traced else (
            not isinstance(model.get_submodule(fqn), nn.Embedding))
        if role == "replicate" and not inside_layers and on_split_stream:
            # the final norm, a projection after it (OPT's project_out); not what runs before
            # the layers on the full sequence (an embedding beside the input one, learned
            # positions, OPT's project_in), which the trace tells apart (else names: embeddings)
            if not whole:
                _residual_module(modules[fqn], residual)
            elif fqn in traced.layer_readers:  # gathers the stream: what follows sees it whole
                _whole_reader(modules[fqn], residual, split.full)
        elif cp and not split.sp and not whole and not inside_layers and on_split_stream and role in _TP_SPLIT_ROLES:
            # a tp-split projection after the layers (Qwen4-Exp's hyper-connection mixer) runs
            # on this rank's piece of the sequence too: said so, its weight grads are partial
            # sums over cp, which the applier reduces
            _add_token_split(modules[fqn], Shard(1))
        elif role == "lm_head":
            reads_split = not whole or fqn in traced.layer_readers
            _gathered_lm_head(modules[fqn], residual if reads_split else split.full, cp=cp,
                              keep_cp_split=logits_split_over_cp)


def _own_layout(modules: dict[str, ShardingConfig], fqn: str) -> dict:
    """What a block's entry keeps of the module's own entry when the sequence layout
    rewrites its inputs and outputs: its parameters' placements (GPT-OSS's sinks, AFMoE's
    expert_bias) and, for a module run on this rank's heads, its local sizes and slices."""
    own = modules.get(fqn)
    if own is None:
        return {"state_shardings": {}}
    return {"state_shardings": dict(own.state_shardings), "local_sizes": own.local_sizes,
            "local_slices": dict(own.local_slices)}


def _split_layer_inputs(modules, roles, fqn: str, positions: tuple[int, ...], residual: dict, full: dict) -> None:
    """The layer's other per-token inputs, made on the whole sequence before the layers
    (Gemma 4's per-layer embeddings), cut to the rank's piece as it enters: the sequence
    split dry run found the layer's own code combining them with its piece of the stream.
    Their gradients are gathered back on the way out of the cut."""
    config = modules.get(fqn)
    if config is None:
        config = modules[fqn] = ShardingConfig(state_shardings={}, local_map=True)
        roles[fqn] = "sequence_split"
    length = max(max(positions) + 1, len(config.in_src or ()), len(config.in_dst or ()))
    src = [*(config.in_src or ()), *[None] * length][:length]
    dst = [*(config.in_dst or ()), *[None] * length][:length]
    for position in positions:
        src[position], dst[position] = dict(full), dict(residual)
    config.in_src, config.in_dst, config.local_map = tuple(src), tuple(dst), True


def _whole_reader(config: ShardingConfig, residual: dict, full: dict) -> None:
    """A module reading the layers' output where the code after the layers needs the whole
    sequence: it gathers the stream and computes on all of it (its gradients complete)."""
    config.in_src, config.in_dst, config.local_map = (dict(residual),), (dict(full),), True


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _residual_module(config: ShardingConfig, residual: dict) -> None:
    # local_map module on its sequence piece: the split axes make its weight grads partial
    config.in_src = config.in_dst = (dict(residual),)


def _is_flat_member(fqn: str, child: nn.Module, roles: dict[str, str]) -> bool:
    """A split projection that is a child of the decoder layer itself, not of a block
    module (OPT's and BioGPT's fc1/fc2: their MLP has no module of its own)."""
    return roles.get(fqn) not in (None, "replicate") and not any(_has_params(c) for c in child.children())


def _flat_member(fqn: str, modules, roles, split: _SequenceSplit) -> None:
    """A flat member is its block's boundary itself: one reading the stream gathers it
    over tp (sequence parallel), one handing on a partial sum reduce-scatters it into the
    stream; under cp its tokens stay split (per-token work, weight gradients summed over cp).
    ``flat``: it reads [tokens, hidden] (OPT flattens the stream around its MLP)."""
    cp, residual = split.cp, split.residual
    attention, flat = fqn in split.traced.attention_inputs, fqn in split.traced.flat_inputs
    if attention and cp:
        raise PlanError(f"accelerator.cp_size: {fqn} feeds attention and is a child of the decoder layer "
                        "itself, not of an attention module; context parallel cannot place such a layer yet: "
                        "set cp_size: 1")
    if flat and split.sp:
        raise PlanError(f"accelerator.sequence_parallel: {fqn} reads the layer's tokens flattened ([tokens, "
                        "hidden], no sequence dim) and is a child of the decoder layer itself, so it is where "
                        "sequence parallel would gather and split the sequence; it cannot do that on flattened "
                        "tokens yet: set sequence_parallel: false")
    config = modules[fqn]
    token_dim = 0 if flat else 1
    if cp:
        _add_token_split(config, Shard(token_dim))
        residual = {**residual, CP: Shard(token_dim)}
    tokens = {CP: Shard(token_dim)} if cp else {}
    if roles[fqn] in _PARTIAL_OUTPUT_ROLES:
        config.out_dst = (dict(residual),)
    else:
        config.in_src = (dict(residual),)
        config.in_dst = ({**tokens, TP: Replicate()},)


def _per_input(streams: tuple[int, ...], placement: dict) -> tuple:
    """One placement per stream input (or output) of a block (its positions in ``streams``),
    None between."""
    return tuple(dict(placement) if index in streams else None for index in range(max(streams) + 1))


def _attention_block(fqn, block, modules, roles, split: _SequenceSplit, streams: BlockStreams, *,
                     role: str = "attention_block") -> None:
    """``streams.adds_stream``: the block adds the stream (an input of its own, gathered
    like the others) to its output itself, so its partial sums are reduced before that
    (else the stream would be counted once per tp rank) and it hands on a slice of the
    whole; ``streams.outputs``: the positions of its outputs carrying the stream."""
    cp, residual = split.cp, split.residual
    inner_entries = _inner_entries(fqn, block, modules)
    hand_on_partial = _has_partial_sums(inner_entries, roles) and not streams.adds_stream and not _reads_partial_sums(
        fqn, block, inner_entries, roles, split.traced.reads)
    keep_tokens = role in TOKEN_ATTENTION_ROLES  # allgather_kv, ulysses: the rank's tokens stay split over cp
    seq = {CP: Shard(1) if keep_tokens else Replicate()} if cp else {}
    full = {**seq, TP: Replicate()}
    block_out = {**seq, TP: Partial() if hand_on_partial else Replicate()}
    modules[fqn] = ShardingConfig(**_own_layout(modules, fqn), in_src=_per_input(streams.inputs, residual),
                                  in_dst=_per_input(streams.inputs, full),
                                  out_src=_attention_outputs(streams.outputs, block_out),
                                  out_dst=_attention_outputs(streams.outputs, residual), local_map=True)
    roles[fqn] = role
    for inner in inner_entries:
        if roles[inner] in _PARTIAL_OUTPUT_ROLES and hand_on_partial:
            modules[inner].out_dst = modules[inner].out_src
        if keep_tokens:
            _add_token_split(modules[inner], Shard(1))


# The call every transformers attention makes to its attention function: a block whose
# code has none computes attention itself, where gathered K/V cannot reach.
_ATTENTION_INTERFACE = "ALL_ATTENTION_FUNCTIONS"
# A module class of the project's own that gathers K/V itself (the fused attention
# replacement) says so with this class attribute.
KV_GATHER_MARK = "hyper_gathers_kv_over_cp"
# The attention implementations the cp wrappers run inside (context_parallel.ATTENTION_NAMES:
# the implementation's name, or its wrapper's once the applier routed it).
_SPLITTABLE_IMPLEMENTATIONS = (*ATTENTION_NAMES, *ATTENTION_NAMES.values())


def _kv_gather_refusal(fqn: str, block: nn.Module, streams: BlockStreams, traced: TracedFacts, *, algorithm: str,
                       implementation: str | None) -> str:
    """Why ``block`` cannot keep each cp rank's tokens through its attention ('' when it
    can). allgather_kv and ulysses need the block's attention to go through the attention
    interface (or the project's own gathering attention) with an eager or sdpa
    implementation (``implementation``: the model config's; None for a model of the
    project's own), and a block with one stream in and out: the applier wraps the attention
    function and slices the rotary embeddings the block is handed; anything else would see
    only the rank's keys. From ``traced``: why the block failed its dry run on one rank's
    tokens (``token_attention_refusals``), and the modules whose parameters the model's
    code uses outside their forward (``read_outside``; JetMoE's attention experts): kept
    tokens make them DTensors there among plain tensors."""
    what = f"{fqn} ({type(block).__name__})"
    if not streams.single:
        return (f"{what} takes or hands on more than one stream (it adds the residual itself, or returns several), "
                f"which {algorithm} cannot place yet")
    if any(getattr(type(module), KV_GATHER_MARK, False) for module in block.modules()):
        return "" if algorithm == "allgather_kv" else (
            f"{what} is the project's fused attention, which gathers K/V itself (allgather_kv) and does not "
            f"exchange heads")
    sources = [_forward_source(module) for module in block.modules()]
    if not any(_ATTENTION_INTERFACE in source for source in sources):
        return (f"{what} computes attention in its own code, not through transformers' attention interface "
                f"({_ATTENTION_INTERFACE}), so its keys and values cannot be exchanged over cp")
    outside = sorted(f"{fqn}.{name}" if name else fqn for name, _ in block.named_modules()
                     if (f"{fqn}.{name}" if name else fqn) in traced.read_outside)
    if outside:
        return (f"{what}: the model's code uses the parameters of {outside[0]} outside its forward, where they stay "
                f"plain tensors beside the cp-split ones")
    if any("alibi" in source for source in sources):
        return f"{what} takes ALiBi position biases computed for the whole sequence, which {algorithm} does not slice"
    if implementation is not None and implementation not in _SPLITTABLE_IMPLEMENTATIONS:
        return (f"{what} runs the attention implementation {implementation!r}, and {algorithm} wraps eager or sdpa "
                f"(model.attn_implementation)")
    dry_run = traced.token_attention_refusals.get(fqn, "")
    if dry_run:
        return f"{what}: a dry run of the block on each cp rank's tokens, on a tiny copy: {dry_run}"
    return ""


def _keeps_tokens(fqn: str, block: nn.Module, split: _SequenceSplit, implementation: str | None,
                  streams: BlockStreams) -> bool:
    """Whether the attention block ``fqn`` keeps each cp rank's tokens (role
    ``split.split_attention``). One that cannot is refused where the recipe named the
    algorithm; where it is the default it gathers the sequence instead, and
    ``split.gathered`` records why."""
    algorithm = TOKEN_ATTENTION_ROLES[split.split_attention]
    why = _kv_gather_refusal(fqn, block, streams, split.traced, algorithm=algorithm, implementation=implementation)
    if not why:
        return True
    key = "accelerator.context_parallel.algorithm"
    if not split.layout.context_parallel.by_default:
        fix = ("allgather_kv" if "fused attention" in why else
               "gather_sequence (every cp rank computes the whole sequence's attention)")
        raise PlanError(f"{key}: {algorithm}: {why}; set {key}: {fix}")
    split.gathered[fqn] = why
    return False


def _forward_source(module: nn.Module) -> str:
    """The source of the module class's forward ('' when unreadable)."""
    import inspect

    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def _attention_outputs(outputs: tuple[int, ...], placement: dict) -> tuple:
    """The stream outputs' placements; with the stream first only, written ``(p, None)``:
    the attention's weights (its second output) stay as they are, as plans say it."""
    return (dict(placement), None) if outputs == (0,) else _per_input(outputs, placement)


def _has_partial_sums(inner_entries: list[str], roles: dict[str, str]) -> bool:
    """Some member of the block hands on a partial sum over tp (rowwise, experts); a block
    whose members are all replicated (GPT-2's Conv1D attention) computes its output whole."""
    return any(roles.get(inner) in _PARTIAL_OUTPUT_ROLES for inner in inner_entries)


def _reads_partial_sums(fqn: str, block: nn.Module, inner_entries: list[str], roles: dict[str, str],
                        reads: frozenset[tuple[str, str]]) -> bool:
    """Whether a module of the block reads the output of one of its partial-sum members
    (rowwise, experts): a norm of a partial sum is not the partial sum of a norm."""
    partial = {pattern(inner) for inner in inner_entries if roles.get(inner) in _PARTIAL_OUTPUT_ROLES}
    inside = {pattern(f"{fqn}.{name}") for name, _ in block.named_modules() if name}
    return any(reader in inside and source in partial for reader, source in reads)


def _mlp_block(fqn, block, modules, roles, split: _SequenceSplit, streams: BlockStreams) -> None:
    """An MLP or MoE block on the rank's tokens: its input gathered over tp (sp), its
    output's partial sums handed on where nothing in the block reads them (``traced``: the
    routers and which modules read which)."""
    cp, traced, residual = split.cp, split.traced, split.residual
    routers = traced.routers
    inner_entries = _inner_entries(fqn, block, modules)
    moe = any(roles.get(inner) == "packed_experts" or inner in routers for inner in inner_entries)
    token_dim = 0 if moe else 1  # MoE blocks flatten [batch, seq, hidden] to [tokens, hidden]
    tokens = {CP: Shard(1)} if cp else {}
    # Partial sums may cross the block's plain code only if that code is linear in them,
    # and no module of the block may read them.
    hand_on_partial = _has_partial_sums(inner_entries, roles) and not streams.adds_stream and not (
        moe and _plain_code_gates(fqn, block, roles)) and not _reads_partial_sums(fqn, block, inner_entries, roles,
                                                                                  traced.reads) \
        and not _replicated_weights(fqn, block, roles, routers)
    block_out = Partial() if hand_on_partial else Replicate()
    modules[fqn] = ShardingConfig(**_own_layout(modules, fqn), in_src=_per_input(streams.inputs, residual),
                                  in_dst=_per_input(streams.inputs, {**tokens, TP: Replicate()}),
                                  out_src=_per_input(streams.outputs, {**tokens, TP: block_out}),
                                  out_dst=_per_input(streams.outputs, residual),
                                  local_map=True)
    roles[fqn] = "moe_block" if moe else "mlp_block"
    for inner in inner_entries:
        config = modules[inner]
        if roles[inner] in _PARTIAL_OUTPUT_ROLES and hand_on_partial:
            config.out_dst = config.out_src
        if cp:
            _add_token_split(config, Shard(token_dim))


def _handoff_block(fqn, block, modules, roles, split: _SequenceSplit, streams: BlockStreams) -> None:
    """A recurrent block run on the rank's tokens, its state handed on over cp
    (``state_handoff.py``): laid out like an MLP block, and the parameters of its members
    that its own code reads outside their forward (a convolution weight handed to a
    kernel) placed by the block's entry (dotted), so they are local tensors there."""
    _mlp_block(fqn, block, modules, roles, split, streams)  # cp splits the sequence: the state is handed on
    traced = split.traced
    config = modules[fqn]
    config.state_handoff, roles[fqn] = CP, "state_handoff"
    for inner in _inner_entries(fqn, block, modules):
        if inner in traced.read_outside:
            relative = inner[len(fqn) + 1:]
            for name, named in modules.pop(inner).state_shardings.items():
                config.state_shardings[f"{relative}.{name}"] = named
            roles.pop(inner, None)


def _replicated_weights(fqn: str, block: nn.Module, roles: dict[str, str], routers: frozenset[str]) -> list[str]:
    """Members of the block that compute whole on every tp rank with weights of their own
    (NemotronH's non-gated experts, which no split role fits), other than the router: their
    output is whole, not a term of a partial sum, so the block's output cannot be handed
    on as one (it would be counted tp times)."""
    found = []
    for name, module in block.named_modules():
        inner = f"{fqn}.{name}"
        if not name or roles.get(inner) != "replicate" or inner in routers:
            continue
        if any(p.dim() >= 3 for p in module.parameters(recurse=False)):
            found.append(inner)
    return found


def _plain_code_gates(fqn: str, block: nn.Module, roles: dict[str, str]) -> list[str]:
    """Replicated gates other than the router inside an MoE block (Qwen2-MoE's
    ``shared_expert_gate``): the block's own code multiplies their output with an expert
    output (``sigmoid(gate(x)) * shared_out``), outside any hook. Were that output a
    partial sum over tp, the gate's gradient (and the input gradient through it) would be
    a partial sum that nothing reduces. The router is the replicated module whose weight
    has one row per expert; its output goes into the experts module, whose hooks handle it."""
    experts = [module for name, module in block.named_modules()
               if name and roles.get(f"{fqn}.{name}") == "packed_experts"]
    expert_counts = {p.shape[0] for module in experts for p in module.parameters(recurse=False) if p.dim() == 3}
    gates = []
    for name, module in block.named_modules():
        if not name or roles.get(f"{fqn}.{name}") != "replicate":
            continue
        weights = [p for p in module.parameters(recurse=False) if p.dim() >= 2]
        if weights and not all(w.shape[0] in expert_counts for w in weights):
            gates.append(f"{fqn}.{name}")
    return gates


def _inner_entries(fqn: str, block: nn.Module, modules) -> list[str]:
    return [f"{fqn}.{name}" for name, _ in block.named_modules() if name and f"{fqn}.{name}" in modules]


def _add_token_split(config: ShardingConfig, placement) -> None:
    """Tokens inside an MLP block are split over cp: every IO entry says so (no
    communication: source and destination agree on cp); an entry without IO gets one."""
    if config.in_src is None and config.in_dst is None:
        config.in_src = config.in_dst = ({CP: placement},)
        return
    for key in IO_PLACEMENT_FIELDS:
        value = getattr(config, key)
        if value is not None:
            setattr(config, key, tuple(None if named is None else {CP: placement, **named} for named in value))


def _gathered_lm_head(config: ShardingConfig, residual: dict, *, cp: bool, keep_cp_split: bool) -> None:
    seq = {CP: Shard(1)} if cp else {}
    config.in_src = (dict(residual),)
    config.in_dst = ({**seq, TP: Replicate()},)
    config.out_src = ({**seq, TP: Shard(-1)},)
    out_seq = {CP: Shard(1) if keep_cp_split else Replicate()} if cp else {}
    config.out_dst = ({**out_seq, TP: config.out_dst[0][TP]},)


def _keep_logits_vocab_sharded(modules, roles) -> None:
    for fqn, role in roles.items():
        if role == "lm_head":
            config = modules[fqn]
            config.out_dst = ({**config.out_dst[0], TP: Shard(-1)},)
