"""Roles from dataflow: what each module does, read from one forward of a tiny real copy.

The planner's names and TP-plan hints say what a module is called; this module says what
it does. One forward of a tiny random-weight instance of the model (the recipe's config
with the verify probe's widths, full depth, replacements applied) is traced with every
tensor tagged by the modules its values come from (``value_trace.py``). From the tags
(``analyze``): the **stream** is everything the output head reads (the embeddings and
every module that adds to the residual stream); the projections joined by edges off the
stream form **blocks** (``linear_blocks.py``), each measured for a split over tp and
dry-run on one rank's widths (``local_widths_dry_run.py``); the rest of ``Dataflow`` says
what a sequence split needs to know (which modules feed attention, add the stream
themselves, read it flattened, hand out parameters ...), with the sequence-split, state
hand-off and token-attention dry runs' verdicts under sp and cp. ``roles_for`` gives the
roles by the planned model's names (``stand_ins.py``).
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from hyper_parallel.distributed.model_parts import decoder_layers, input_embeddings, output_embeddings
from hyper_parallel.planning.handoff_check import handoff_blocks, recurrent_candidates
from hyper_parallel.planning.linear_blocks import HEAD_ROLES, SPLIT_MODE, Block, find_blocks, plan_blocks
from hyper_parallel.planning.sequence_dry_run import check_sequence_split, is_attention, whole_over_cp
from hyper_parallel.planning.stand_ins import StandIns, pattern
from hyper_parallel.planning.token_attention_dry_run import token_attention_refusals
from hyper_parallel.planning.value_trace import TagResolver, TracedForward, is_norm, own_params, trace_forward


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
    # sequence split its gradient cannot be placed (``ParameterHandOuts``).
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


def analyze(model: nn.Module, input_ids: torch.Tensor, *, tp: int,
            dry_run: Callable[[nn.Module, dict[str, int], Block], str | None] | None = None,
            sequence_split: str | None = None) -> Dataflow:
    """Trace ``model`` (a tiny real instance) on ``input_ids`` and plan its blocks for ``tp``;
    with ``sequence_split`` ("sp": sequence parallel alone, "cp": context parallel), also
    dry-run the split of the stream along the sequence (``sequence_dry_run.py``)."""
    # Training mode: the plan is for training, and some code paths exist only there (Gemma 3n
    # clamps AltUp's coefficients and multiplies by them itself). The copy has no dropout.
    model.train(True)
    trace = trace_forward(model, input_ids)
    resolve = TagResolver(trace)
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
                if not is_norm(module) and name not in (head_name, embed_name) and name not in routers]
    # A block whose member's parameters the model's code uses outside the member (a module
    # handing its weight to a matmul of its parent) is not split: a split weight would be a
    # DTensor there, among plain tensors. Its members stay off blocks: replicated, plain.
    blocks = [block for block in find_blocks(trace, resolve, matrices, stream)
              if not set(block.members) & trace.mode.read_outside]
    plan_blocks(trace, blocks, tp, dry_run)
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


def _downstream(trace: TracedForward, resolve: "TagResolver", inside: Callable[[str], bool], skip: frozenset,
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


def _replicable_containers(model: nn.Module, trace: TracedForward, blocks: list[Block]) -> frozenset[str]:
    """Modules with parameters of their own and parameterized children (DeepSeek-V4's
    compressor: a position bias beside its projections) that returned values, holding no
    member of a split block: what they compute from their own parameters is whole on every
    rank. (One returning only integers, an indexer's top-k, is left to the names.)"""
    split = [name for block in blocks if block.mode == SPLIT_MODE for name in (*block.members, *block.norms)]
    return frozenset(name for name, module in model.named_modules()
                     if name and name not in trace.leaves and name in trace.outputs and own_params(module)
                     and not any(member.startswith(name + ".") for member in split))


def roles_for(model: nn.Module, flow: Dataflow) -> dict[str, str]:
    """The dataflow roles by the planned model's module names (``StandIns``); a name whose
    stand-ins have more than one role gets none."""
    traced = flow.roles()
    stand_ins = StandIns(traced)
    roles = {}
    for name, module in model.named_modules():
        # a head split is its class's own code run on a share: never stood in for by another class
        found = {traced[other] for other in stand_ins(name)
                 if traced[other] not in HEAD_ROLES or flow.same_class(other, module)}
        if len(found) == 1:
            roles[name] = found.pop()
    return roles
