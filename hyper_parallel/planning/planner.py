"""The sharding planner: an HF model's structure (on the meta device) -> per-module plan.

Roles come from structure: linears named like attention / MLP projections, the input
and output embeddings, packed expert weights, norms on a projection; and from the
model's own TP plan (``base_model_tp_plan`` / ``_tp_plan``), read by what each style
*means* (``roles.TP_STYLES``): the input it expects and the output it hands on. A hint
is used only where it agrees with the module it sits on and with its neighbours:

- a linear-kind style on a linear decides whether it splits its output (colwise) or
  hands on every feature (colwise_gather_output); q, k and v (gate and up) must agree;
- a rowwise projection takes its input as the projections of its block hand it on:
  split after colwise ones (rowwise), full after gathered ones (rowwise_split_input);
  its own hint only chooses where the block has both;
- a norm on a projection (q_norm, k_norm, or hinted replicated_with_grad_allreduce) sees
  what that projection hands on: all of it when gathered (replicate), its heads when
  split (head_norm, or projection_norm for a norm over the whole projection);
- the model's input and output embeddings and packed experts are what they are; a hint
  of another kind on any module is ignored for the structure's role.

A style the planner does not know, or one no role here means, fails planning with the
module, the style and the ``plan_overrides`` entry that would place the module instead.
Each role maps to one ``ShardingConfig`` over the ``tp`` axis (``roles.py``).

On top of the TP roles, ``sequence_layout`` applies sequence parallel, context
parallel and loss parallel, and ``expert_layout`` expert parallel. Forms the plan does
not apply (pp: the runtime's stage splitting; dp: the trainer's FSDP2) are listed in
``recorded_axes`` with the reason.

Given the recipe's ``plan_overrides``, the planner merges them after the layouts and
before the lints, so the lints see the plan as applied; a module it cannot classify
is then no error if an override places it (the override is its whole entry).
"""

import copy
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard

from hyper_parallel.config.context_parallel import ContextParallel
from hyper_parallel.config.layout import Layout
from hyper_parallel.config.plan_override import PlanOverride
from hyper_parallel.distributed.context_parallel import ATTENTION_ROLE
from hyper_parallel.distributed.mesh import ParallelDims
from hyper_parallel.distributed.model_parts import decoder_layers, input_embeddings, output_embeddings
from hyper_parallel.distributed.name_match import plan_entry_for
from hyper_parallel.hf_config_keys import layer_views
from hyper_parallel.planning.dataflow import Dataflow, roles_for
from hyper_parallel.planning.expert_layout import apply_expert_layout
from hyper_parallel.planning.linear_blocks import HEAD_SPLIT_ROLE, PLACED_BY_PARENT_ROLE, SPLIT_MODE
from hyper_parallel.planning.offline_mesh import OfflineMesh, build_offline_mesh
from hyper_parallel.planning.plan_lint import PlanError, heads_not_dividing, lint_config_divisibility, lint_plan
from hyper_parallel.planning.plan_overrides import merge_plan_overrides, overridden_modules
from hyper_parallel.planning.roles import (
    ANY,
    COLWISE_NAMES,
    EMBEDDING,
    FULL,
    FUSED_GATE_UP_NAMES,
    FUSED_QKV_NAMES,
    HEAD_NORM_NAMES,
    LINEAR,
    PARTIAL_SUM_ROLES,
    ROLE_BUILDERS,
    ROUTER_NAMES,
    ROWWISE_NAMES,
    SPLIT,
    StyleMeaning,
    is_packed_experts,
    parameter_placement,
    style_meaning,
)
from hyper_parallel.planning.sequence_layout import TracedFacts, apply_sequence_layout
from hyper_parallel.planning.stand_ins import StandIns
from hyper_parallel.protocols.axes import CP, EP, SIZE_AXES, SP, TP
from hyper_parallel.protocols.placements import placement_to_text
from hyper_parallel.protocols.sharding import IO_PLACEMENT_FIELDS, ShardingConfig

__all__ = ["PlanError", "PlanResult", "ShardingPlanner", "merge_plan_overrides"]

# What a projection hands on to the next op of its block: this rank's features or all of them.
# Split roles exact only beside a partner (a colwise producer's split output needs a rowwise
# consumer, and the other way round); gathered and split-input ones are exact on their own.
_UNPARTNERED_ROLES = frozenset({"colwise", "rowwise", "fused_qkv", "fused_gate_up"})
_PRODUCER_LAYOUTS = {"colwise": SPLIT, "fused_qkv": SPLIT, "fused_gate_up": SPLIT, "colwise_by_parent": SPLIT,
                     "colwise_gathered": FULL}
# What a rowwise projection expects, by role.
_CONSUMER_EXPECTS = {"rowwise": SPLIT, "rowwise_split_input": FULL}
_CONSUMER = "rowwise (input as its block hands it on)"  # a rowwise by name, role from its block
# Projections one op combines (attention scores and values; gate * up): split alike or not at all.
_AGREEING_GROUPS = (frozenset({"q_proj", "k_proj", "v_proj"}), frozenset({"gate_proj", "up_proj"}),
                    frozenset({"w1", "w3"}))

# Forms the plan applies besides tp (sequence_layout.py: sp, cp, loss_parallel; expert_layout.py: ep).
_APPLIED = frozenset({SP, CP, "loss_parallel", EP})
_NOT_APPLIED = {
    "pp": "pipeline parallel runs in the trainer (torch.distributed.pipelining); the plan records the stage split",
    "dp": "data parallel is applied by the trainer (FSDP2 fully_shard), not by the plan",
}

_UNPLACED = {
    "ep": "no experts module of this model is one expert parallel splits (packed experts with a num_experts "
          "count): the ep ranks keep every expert and split the batch, as data parallel",
}


@dataclass
class PlanResult:
    modules: dict[str, ShardingConfig]
    applied_axes: list[str]
    recorded_axes: dict[str, str]
    roles: dict[str, str] = field(default_factory=dict)
    dataflow_error: str = ""  # why the planner went without the dataflow (its trace failed)
    notes: tuple[str, ...] = ()  # decisions a reader of the plan should know (derive prints them)
    # how attention is split over cp (None without cp); the plan document records it
    context_parallel: ContextParallel | None = None


def _ulysses_heads(config, dims: ParallelDims) -> None:
    """Ulysses hands each cp rank a group of the heads tp left it: tp*cp must divide the
    query heads and the kv heads."""
    split = dims.tp * dims.cp
    for name in ("num_attention_heads", "num_key_value_heads"):
        count = getattr(config, name, None)
        if isinstance(count, int) and count % split:
            raise PlanError(f"accelerator.context_parallel.algorithm: ulysses splits the heads over tp*cp = "
                            f"{dims.tp}*{dims.cp} = {split}, which does not divide {name}={count}; use "
                            f"algorithm: allgather_kv (or gather_sequence), or a cp_size/tp_size that divides it")


class UnclassifiedModule(PlanError):
    """A module with parameters that no rule gives a role: not its type, its name, the
    model's TP plan or the dataflow. Inside a decoder layer its part of the layer is left
    whole (``_replicate_layer_parts``); elsewhere it is refused."""


class StyleRefusal(PlanError):
    """A module whose TP-plan style the planner will not use: unknown, or meaning something
    no role here means. The planner goes on with ``fallback_role`` in its place (what the
    structure alone gives it; None for a module without parameters), so that the final
    message can show the plan_overrides entry as the finished plan would hold it."""

    def __init__(self, fqn: str, module: nn.Module, style: str, why: str):
        self.fqn, self.style = fqn, style
        self.fallback_role: str | None = None
        self.head = (f"cannot plan module {fqn or '<root>'} ({type(module).__name__}): the TP plan gives it "
                     f"style {style!r}, {why}")
        super().__init__(self.head)


# HF's ``moe_identity_expert`` is planned only on what it is written for: a zero-compute
# expert (``nn.Identity``, no parameters) inside experts whose output is a partial sum.
_IDENTITY_ONLY = ("which makes an identity (zero-compute) expert's output one term of its experts' partial sum over "
                  "tp; it is planned only on an nn.Identity without parameters, which this module is not")


class ShardingPlanner:
    def __init__(self, model: nn.Module, *, dims: ParallelDims, mesh: OfflineMesh,
                 sequence_parallel: bool = False, loss_parallel: bool = False, hints: dict | None = None,
                 overrides: Iterable[PlanOverride] | None = None, dataflow: Dataflow | None = None,
                 dataflow_error: str = "", context_parallel: ContextParallel | None = None):
        self.model = model
        # The one Layout of what was asked: it makes the context-parallel setting effective.
        self.layout = Layout(dims=dims, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                             context_parallel=context_parallel or ContextParallel())
        self.context_parallel = self.layout.context_parallel
        self.dataflow, self.dataflow_error = dataflow, dataflow_error
        self.flow_roles: dict[str, str] = {}  # blocks the names and hints do not classify whole
        self.flow_fallback: dict[str, str] = {}  # where names and hints give no role
        self._attention_feeders: frozenset[str] | None = None
        self.overrides = list(overrides or ())
        self.dims = dims
        self.mesh = mesh
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self.hints = {**_model_tp_hints(model), **(hints or {})}

    @classmethod
    def for_layout(cls, model: nn.Module, layout: Layout, **kwargs: Any) -> "ShardingPlanner":
        """The planner of ``layout`` on its offline mesh (``kwargs``: overrides, dataflow...)."""
        return cls(model, dims=layout.dims, mesh=build_offline_mesh(layout.dims),
                   sequence_parallel=layout.sequence_parallel, loss_parallel=layout.loss_parallel,
                   context_parallel=layout.context_parallel, **kwargs)

    def plan(self) -> PlanResult:
        self.dims.validate()
        if "tp" not in self.mesh.axis_names or self.mesh.size("tp") != self.dims.tp:
            raise PlanError(f"offline mesh {dict(zip(self.mesh.axis_names, self.mesh.sizes))} does not match "
                            f"tp_size={self.dims.tp}")
        config = getattr(self.model, "config", None)
        # Multi-query attention's one kv head, which no tp > 1 splits: attention is left whole
        # where the dataflow shows which modules it is, and the rest of the layer split. (Other
        # head counts tp does not divide are refused: a tp that divides them exists.)
        uneven_heads = heads_not_dividing(config, self.dims.tp) if config is not None and self.dims.tp > 1 else []
        if uneven_heads != ["num_key_value_heads=1"]:
            uneven_heads = []
        self._prepare_flow()
        whole_attention = bool(uneven_heads) and bool(self._attention_parts())
        if config is not None and self.dims.cp > 1 and self.context_parallel.algorithm == "ulysses":
            _ulysses_heads(config, self.dims)
        lint_config_divisibility(config, self.dims, whole_attention=whole_attention)
        active_axes = self.dims.active_axes(sequence_parallel=self.sequence_parallel)
        overridden = overridden_modules(self.overrides, self.model, active_axes=active_axes)
        modules: dict[str, ShardingConfig] = {}
        roles: dict[str, str] = {}
        refusals: list[StyleRefusal] = []
        unclassified: dict[str, nn.Module] = {}
        planned_with: dict[int, str] = {}  # id(a parameter) -> the module first planned holding it
        for fqn, module in self.model.named_modules():
            twin = _tied_twin(self.model, module, planned_with, modules)
            if twin is not None:  # the same parameters as a module planned before (Zamba's shared block)
                roles[fqn], modules[fqn] = roles[twin], copy.deepcopy(modules[twin])
                continue
            planned_with.update({id(p): fqn for p in module.parameters(recurse=False)})
            try:
                if not _has_own_params(module) and self.flow_roles.get(fqn) == HEAD_SPLIT_ROLE:
                    roles[fqn], modules[fqn] = HEAD_SPLIT_ROLE, self._head_split_entry(fqn)
                    continue
                if not _has_own_params(module):
                    role = self._container_role(fqn, module, roles)
                    if role is not None:
                        roles[fqn], modules[fqn] = role, ROLE_BUILDERS[role](module, {})
                    continue
                role = self._role(fqn, module)
                if role == PLACED_BY_PARENT_ROLE:
                    continue  # its parameters are placed by its parent's head_split entry
                config = (self._head_split_entry(fqn) if role == HEAD_SPLIT_ROLE
                          else ROLE_BUILDERS[role](module, self._param_hints(fqn, module)))
            except PlanError as err:
                if fqn in overridden:
                    continue  # the recipe places it; merge_plan_overrides checks the entry is complete
                if not isinstance(err, StyleRefusal) and fqn in self.flow_fallback:
                    role = self.flow_fallback[fqn]
                    roles[fqn], modules[fqn] = role, ROLE_BUILDERS[role](module, {})
                    continue
                if self._splits_no_module() or isinstance(err, StyleRefusal) and self.dims.tp == 1:
                    # nothing is split per module (or nothing over tp, which the refused style is
                    # about): whole weights are exact, the module needs no tensor-parallel role
                    roles[fqn], modules[fqn] = "replicate", ROLE_BUILDERS["replicate"](module, {})
                    continue
                if isinstance(err, UnclassifiedModule) and (self._layer_part(fqn, strictly_inside=True) or (
                        self._layer_part(fqn) is not None and _holds_projections(module))):
                    # its part of the layer is left whole below (a layer part of its own with
                    # parameters besides its projections, RWKV's time-mix vectors: whole with them)
                    unclassified[fqn] = module
                    continue
                if not isinstance(err, StyleRefusal):
                    if self.dataflow_error:
                        raise PlanError(f"{err} (the planner went by names and hints only: {self.dataflow_error})")
                    raise
                refusals.append(err)
                err.fallback_role = self._fallback_role(fqn, module)
                if err.fallback_role is None:
                    continue
                role, config = err.fallback_role, ROLE_BUILDERS[err.fallback_role](module, {})
            roles[fqn], modules[fqn] = role, config
        whole_parts: dict[str, str] = {}
        for fqn, module in unclassified.items():
            what = f"{_layer_glob(fqn)} ({type(module).__name__}; parameters {_params_text(module)})"
            part = self._layer_part(fqn)
            if what not in whole_parts.get(part, ""):
                whole_parts[part] = f"{whole_parts[part]}, {what}" if part in whole_parts else what
        whole_parts = {part: f"{what} has no tensor-parallel role from its type, its name or the model's TP plan"
                       for part, what in whole_parts.items()}
        if whole_attention:
            whole_parts.update({part: f"tp_size={self.dims.tp} does not divide {', '.join(uneven_heads)}, so its "
                                      "heads cannot be split" for part in self._attention_parts()})
        notes = self._replicate_layer_parts(whole_parts, modules, roles, overridden)
        traced = self._traced_facts()
        gathered = apply_sequence_layout(self.model, modules, roles, cp=self.dims.cp > 1, sp=self.sequence_parallel,
                                         loss_parallel=self.loss_parallel, traced=traced,
                                         split_attention=ATTENTION_ROLE.get(self.context_parallel.algorithm, ""),
                                         split_by_default=self.context_parallel.by_default,
                                         hand_state_on=not self.context_parallel.load_balance)
        notes += self._gathered_attention_notes(gathered)
        notes += self._cp_recurrent_notes(roles, traced.handoff_refusals)
        apply_expert_layout(self.model, modules, roles, ep=self.dims.ep)
        if refusals:
            raise PlanError(_refusals_message(refusals, modules))
        if self.overrides:
            modules = merge_plan_overrides(modules, self.overrides, self.model, active_axes=active_axes)
            roles.update({fqn: "override" for fqn in modules if fqn not in roles})
        lint_plan(self.model, modules, self.mesh)
        applied = self._applied_axes(modules)
        return PlanResult(modules=modules, applied_axes=applied,
                          recorded_axes=self._recorded_axes(applied), roles=roles, dataflow_error=self.dataflow_error,
                          notes=tuple(notes),
                          context_parallel=self.context_parallel if self.dims.cp > 1 else None)

    def _gathered_attention_notes(self, gathered: dict[str, str]) -> list[str]:
        """The attention blocks the default algorithm could not split, one note per layer
        pattern with the first block's reason: the plan's reader sees where cp does not
        split the attention work, and why."""
        algorithm = self.context_parallel.algorithm
        first: dict[str, str] = {}
        for fqn in sorted(gathered):
            first.setdefault(_layer_glob(fqn), gathered[fqn])
        return [f"{block} gathered over cp: accelerator.context_parallel.algorithm is left to its default "
                f"({algorithm}), which this block cannot run: {why}; every cp rank computes its attention over the "
                f"whole sequence (exact, as gather_sequence; its work not split by cp)" for block, why in first.items()]

    def _cp_recurrent_notes(self, roles: dict[str, str], refusals: dict[str, str]) -> list[str]:
        """What cp does to the blocks reading other positions of the sequence (recurrences,
        convolutions): the state handed from rank to rank, or the block gathered, and why
        (``refusals``: the hand-off check's reasons, by module)."""
        handed = sorted({_layer_glob(fqn) for fqn, role in roles.items() if role == "state_handoff"})
        notes = [f"{block} under cp: each rank runs its piece of the sequence from the state the previous cp rank "
                 "hands on (the layer's own cache protocol: recurrent state and convolution inputs), one rank "
                 "after another: exact, activations split by cp, the recurrence's work not" for block in handed]
        for block in sorted({_layer_glob(fqn) for fqn, role in roles.items() if role == "gathered_block"}):
            why = next((refusals[fqn] for fqn in sorted(refusals) if _layer_glob(fqn) == block), "")
            if self.context_parallel.load_balance:
                why = ("; context_parallel.load_balance gives each rank two pieces from both ends, so no state is "
                       "handed from rank to rank (load_balance: false hands it on where the layer allows)")
            elif why:
                why = f"; its state is not handed from rank to rank: {why}"
            notes.append(f"{block} gathered over cp: the model's code uses its parameters outside its modules' forward "
                         f"(a recurrence handing its convolution weight to a kernel), so every cp rank runs it on the "
                         f"whole sequence{why}; exact, its work and activations not split by cp")
        return notes

    def _layer_part(self, fqn: str, *, strictly_inside: bool = False) -> str | None:
        """The decoder layer's child holding ``fqn`` (``model.layers.3.self_attn`` for
        ``model.layers.3.self_attn.compressor.indexer``) as a name relative to its layer
        (``self_attn``); None outside the layers or for the layer itself, and with
        ``strictly_inside`` also for the child itself (a projection of the layer's own,
        whose neighbours are split around it: replicating it alone is not exact)."""
        found = decoder_layers(self.model)
        if found is None or not fqn.startswith(found[0] + "."):
            return None
        parts = fqn[len(found[0]) + 1:].split(".")
        if len(parts) < (3 if strictly_inside else 2):
            return None
        return parts[1]

    def _attention_parts(self) -> list[str]:
        """The layer parts (``_layer_part``) holding the projections the dataflow saw feed
        an attention's q, k or v; empty without a dataflow."""
        return sorted({part for name in self._attention_inputs() if (part := self._layer_part(name)) is not None})

    def _replicate_layer_parts(self, whole_parts: dict[str, str], modules: dict[str, ShardingConfig],
                               roles: dict[str, str], overridden: set[str]) -> list[str]:
        """Leave these parts of every decoder layer whole: every module with parameters in
        them replicated, as transformers' own tensor parallel leaves what its plan does not
        name. A module no rule classifies (DeepSeek-V4's indexer: a matrix of its own, no
        Linear) or heads tp cannot split (one kv head) put them here. Whole weights on whole
        inputs are exact at any tp; replicating one module alone would not be, where the
        modules around it split what it reads. Returns one note per part (part -> why) for
        the derive log."""
        found = decoder_layers(self.model)
        notes = []
        for part, why in sorted(whole_parts.items()):
            inside = re.compile(rf"{re.escape(found[0])}\.\d+\.{re.escape(part)}(\..+)?")
            for name, module in self.model.named_modules():
                if inside.fullmatch(name) and _has_own_params(module) and name not in overridden:
                    roles[name], modules[name] = "replicate", ROLE_BUILDERS["replicate"](module, {})
            notes.append(f"{found[0]}.*.{part} replicated whole over tp: {why}; a plan_overrides entry can place "
                         "it instead")
        return notes

    def _splits_no_module(self) -> bool:
        """tp 1 and cp 1 (dp, or ep with nothing tensor-parallel): every module keeps its
        whole weights and whole sequence, so no module needs a role to be planned."""
        return self.dims.tp == 1 and self.dims.cp == 1 and not self.sequence_parallel

    def _requested_axes(self) -> set[str]:
        requested = {name for name in SIZE_AXES if name != TP and getattr(self.dims, name) > 1}
        if self.sequence_parallel:
            requested.add("sp")
        if self.loss_parallel:
            requested.add("loss_parallel")
        return requested

    def _applied_axes(self, modules: dict[str, ShardingConfig]) -> list[str]:
        """An axis counts as applied only if it has more than one rank and some plan entry
        places something on it (sp and loss parallel ride on tp)."""
        placed = {axis for axis in _axes_placed(modules) if getattr(self.dims, axis, 1) > 1}
        applied = ["tp"] if "tp" in placed else []
        for name in sorted(self._requested_axes() & _APPLIED):
            if name in (SP, "loss_parallel") and TP in placed or name in placed:
                applied.append(name)
        return applied

    def _recorded_axes(self, applied: list[str]) -> dict[str, str]:
        """Requested axes the plan does not apply, with why: those the runtime owns, and
        those nothing in this model could be placed on (ep without experts the plan can
        split: the ep ranks then keep every expert and split the batch, as dp)."""
        recorded = {name: _NOT_APPLIED[name] for name in sorted(self._requested_axes() - _APPLIED)}
        for name in sorted((self._requested_axes() & _APPLIED) - set(applied)):
            recorded[name] = _UNPLACED.get(name, f"{name} was requested, but no plan entry places anything on it")
        return recorded

    # --- dataflow ----------------------------------------------------------------------------

    def _prepare_flow(self) -> None:
        """Which modules the dataflow plans (``dataflow.py``): every member and norm of a
        block whose members the names and hints do not all classify (so a block is planned
        by one source, never half by each), and, as a fallback, any linear or embedding
        the names cannot classify."""
        if self.dataflow is None:
            return
        by_name = roles_for(self.model, self.dataflow)
        modules = dict(self.model.named_modules())
        flow_decided: set[str] = set()  # traced names
        split_inside: set[str] = set()
        for block in self.dataflow.blocks:
            named = {name: self._named_role(name, modules[name]) if name in modules else None
                     for name in block.members}
            if block.heads is not None and block.mode == SPLIT_MODE:
                # split on its parent's heads, which names and hints cannot plan (they
                # gather it: transformers' colwise_gather_output on a gated delta-net)
                flow_decided |= {*block.members, *block.norms, block.heads.name, *block.heads.owners()}
                continue
            if not all(named.values()) or not _names_agree(named, block):
                flow_decided |= {*block.members, *block.norms}
                continue
            # A vector module the names replicate, fed only by projections they split (a
            # learned activation between up and down): it sees this rank's features, so
            # its gradient is a partial sum over tp, as a per-head norm's is.
            split_inside |= {norm for norm, feeders in block.norm_inputs.items()
                             if norm in modules and self._named_role(norm, modules[norm]) == "replicate"
                             and all(_PRODUCER_LAYOUTS.get(named.get(f)) == SPLIT for f in feeders)}
        stand_ins = StandIns(self.dataflow.roles())
        standalone = StandIns(self.dataflow.standalone)
        routers = StandIns(self.dataflow.routers)
        in_blocks = StandIns({member for block in self.dataflow.blocks for member in block.members})
        for name, role in by_name.items():
            decided = any(other in flow_decided for other in stand_ins(name))
            # A module the trace saw joined to no other projection (its output read whole)
            # whose name alone would split it with no partner (Inkling-2's o_proj.gate_proj,
            # "colwise" by its name, against a whole attention output): the dataflow decides.
            decided = decided or bool(standalone(name)) and name in modules and self._named_role(
                name, modules[name]) in _UNPARTNERED_ROLES
            # A projection outside every block that the trace saw pick experts is a router,
            # replicated, whatever its name says (ZAYA's router MLP ends in out_proj, "rowwise"
            # by name beside fc1's split). (A block member whose output only reaches a router
            # through the stream, as attention's o_proj can, keeps its block's plan.)
            decided = decided or bool(routers(name)) and not in_blocks(name)
            (self.flow_roles if decided else self.flow_fallback)[name] = role
        if self.dims.tp > 1 and split_inside:
            split = StandIns(split_inside)
            self.flow_roles.update({name: "head_norm" for name in modules if split(name)})

    def _head_split_entry(self, fqn: str) -> ShardingConfig:
        """The entry of a block's parent computed on this rank's heads (``HeadSplit``): its
        other parameters as the heads they serve need them, its size attributes local."""
        splits = {block.heads.name: block.heads for block in self.dataflow.blocks
                  if block.heads is not None and block.mode == SPLIT_MODE}
        module = self.model.get_submodule(fqn)
        found = {id(splits[name]): splits[name] for name in StandIns(splits)(fqn)
                 if self.dataflow.same_class(name, module)}
        if len(found) != 1:
            raise PlanError(f"cannot plan {fqn} on its heads: the traced copy has {len(found)} modules standing "
                            "for it")
        split = next(iter(found.values()))
        states = {name: {TP: placement} for name, placement in split.states.items()}
        if self.dims.dp == 1:
            # A packed parameter of unequal blocks is stored sharded, in packed order
            # (local_views.PackedRows). Under FSDP2, which splits its rows again over dp,
            # it stays replicated over tp and each rank takes its piece as it runs.
            states.update({name: {TP: Shard(dim)} for name, (dim, _) in split.slices.items()})
        return ShardingConfig(state_shardings=states, local_map=True, local_sizes=split.sizes,
                              local_slices=dict(split.slices))

    def _named_role(self, fqn: str, module: nn.Module) -> str | None:
        try:
            return self._role(fqn, module)
        except PlanError:
            return None

    def _routers(self) -> frozenset[str]:
        """The model's linears the dataflow saw pick experts (by stand-in)."""
        if self.dataflow is None:
            return frozenset()
        picking = StandIns(self.dataflow.routers)
        return frozenset(name for name, _ in self.model.named_modules() if name and picking(name))

    def _stand_ins(self, field: str) -> frozenset[str]:
        """The model's modules that stand in (by name pattern) for the traced copy's modules
        in ``Dataflow.<field>`` (``outside_sums``, ``flat_outputs``)."""
        if self.dataflow is None:
            return frozenset()
        traced = StandIns(getattr(self.dataflow, field))
        return frozenset(name for name, _ in self.model.named_modules() if name and traced(name))

    def _traced_facts(self) -> TracedFacts:
        """What the trace saw, in this model's names (empty without a trace)."""
        if self.dataflow is None:
            return TracedFacts()
        return TracedFacts(attention_inputs=self._attention_inputs(), outside_sums=self._stand_ins("outside_sums"),
                           routers=self._routers(), flat_outputs=self._stand_ins("flat_outputs"),
                           flat_inputs=self._stand_ins("flat_inputs"), after_layers=self._stand_ins("after_layers"),
                           layer_readers=self._stand_ins("layer_readers"),
                           value_inputs=self._by_stand_in("value_inputs"),
                           value_outputs=self._by_stand_in("value_outputs"),
                           reads=self.dataflow.reads, split_error=self.dataflow.sequence_split_error,
                           whole_after_layers=self.dataflow.whole_after_layers,
                           split_layer_inputs=self.dataflow.split_layer_inputs,
                           misplaced_hand_outs=self._by_stand_in("misplaced_hand_outs"),
                           read_outside=self._stand_ins("read_outside"),
                           after_layers_called_again=self._stand_ins("after_layers_called_again"),
                           state_handoff=self._same_class_stand_ins("state_handoff"),
                           handoff_refusals=self._by_stand_in("handoff_refusals"),
                           token_attention_refusals=self._by_stand_in("token_attention_refusals", same_class=True),
                           traced=True)

    def _same_class_stand_ins(self, field: str) -> frozenset[str]:
        """``_stand_ins`` by stand-ins of the module's own class only: a hybrid's ``self_attn``
        is a linear attention in one layer and softmax attention in the next."""
        if self.dataflow is None:
            return frozenset()
        traced = StandIns(getattr(self.dataflow, field))
        return frozenset(name for name, module in self.model.named_modules()
                         if name and any(self.dataflow.same_class(other, module) for other in traced(name)))

    def _by_stand_in(self, field: str, *, same_class: bool = False) -> dict:
        """The model's modules -> what ``Dataflow.<field>`` says of their stand-ins: the
        positions of their inputs (``value_inputs``) or outputs (``value_outputs``) that
        carried the stream, how they hand out a parameter (``misplaced_hand_outs``); with
        ``same_class``, of stand-ins of the module's own class only."""
        if self.dataflow is None:
            return {}
        facts = getattr(self.dataflow, field)
        traced = StandIns(facts)
        found = {}
        for name, module in self.model.named_modules():
            stand_ins = traced(name) if name else []
            if same_class:
                stand_ins = [other for other in stand_ins if self.dataflow.same_class(other, module)]
            if stand_ins:
                found[name] = facts[stand_ins[0]]
        return found

    def _attention_inputs(self) -> frozenset[str]:
        """The model's modules whose output reaches an attention's q, k or v (by pattern)."""
        if self.dataflow is None:
            return frozenset()
        if self._attention_feeders is None:
            feeding = StandIns(self.dataflow.attention_inputs)
            self._attention_feeders = frozenset(name for name, _ in self.model.named_modules()
                                                if name and feeding(name))
        return self._attention_feeders

    # --- roles -------------------------------------------------------------------------------

    def _role(self, fqn: str, module: nn.Module, *, use_hint: bool = True) -> str:
        """The module's role: from its kind and neighbours, with its TP-plan hint read by
        meaning where it agrees (module docstring)."""
        if fqn in self.flow_roles:
            return self.flow_roles[fqn]
        meaning = self._hint_meaning(fqn, module) if use_hint else None
        if meaning is not None and meaning.role == "local_params":
            return "local_params"
        if meaning is not None and meaning.role == "local_params_summed":
            return self._summed_role(fqn, module)
        if isinstance(module, nn.Embedding):
            return self._embedding_role(fqn, module, meaning)
        if isinstance(module, nn.Linear):
            return self._linear_role(fqn, module, meaning)
        if is_packed_experts(module):
            return "packed_experts"  # whatever the hint: the shapes give the layout (roles.packed_experts)
        if self._head_vectors(fqn, module)[1]:
            return "local_params"  # attention's own per-head vectors (sinks), split with its heads
        name = _leaf(fqn)
        if name in HEAD_NORM_NAMES or _all_vectors(module):
            return self._norm_role(fqn, module, meaning)
        if name in ROUTER_NAMES:
            return "replicate"
        if meaning is not None and meaning.sits_on == ANY:
            return meaning.role
        if not any(p.requires_grad for p in module.parameters(recurse=False)):
            return "replicate"  # frozen statistics (ERNIE's moe_statics): no gradient to place or reduce
        raise UnclassifiedModule(_unclassified_message(fqn, module))

    def _summed_role(self, fqn: str, module: nn.Module) -> str:
        """``all_reduce`` on a module computing from parameters of its own: a partial sum
        only where a parameter's own entry splits it (``roles.local_params_summed``)."""
        hints = self._param_hints(fqn, module)
        if any(not isinstance(parameter_placement(style, name, module.get_parameter(name).dim()), Replicate)
               for name, style in hints.items()):
            return "local_params_summed"
        raise StyleRefusal(fqn, module, self._module_hint(fqn),
                           "which all-reduces a partial-sum output of the module's own computation, but no entry "
                           "splits a parameter of it, so its output is whole, not a partial sum")

    def _hint_meaning(self, fqn: str, module: nn.Module) -> StyleMeaning | None:
        """What the module's TP-plan style means; None without one. A style this planner
        does not know, or one no role here means, is refused by name."""
        style = self._module_hint(fqn)
        if style is None:
            return None
        meaning = style_meaning(style)
        if meaning is None:
            raise StyleRefusal(
                fqn, module, style, "a style this planner has no meaning for (it maps every style of "
                "transformers' tensor-parallel vocabulary it knows, roles.TP_STYLES)")
        if meaning.role is None:
            raise StyleRefusal(fqn, module, style, meaning.refused)
        if meaning.role == "identity_share":
            raise StyleRefusal(fqn, module, style, _IDENTITY_ONLY)
        return meaning

    def _container_role(self, fqn: str, module: nn.Module, roles: dict[str, str]) -> str | None:
        """A module without parameters of its own is not planned (its children are), but a
        style on it that is unknown, or that changes its children's sums, is refused; the
        one planned is an identity expert's (``roles.identity_share``), where its experts'
        output is a partial sum over tp (the nearest planned ancestor: planned first, as
        ``named_modules`` lists parents before children)."""
        style = self._module_hint(fqn)
        if style is None:
            return None
        meaning = style_meaning(style)
        if meaning is None:
            raise StyleRefusal(fqn, module, style, "a style this planner has no meaning for")
        if meaning.container_ok:
            return None
        if meaning.role != "identity_share":
            raise StyleRefusal(fqn, module, style, meaning.refused)
        if not isinstance(module, nn.Identity):
            raise StyleRefusal(fqn, module, style, _IDENTITY_ONLY)
        if self.dims.tp == 1:
            return None  # no partial sum over tp: the expert's output counts once as it is
        owner = max((name for name in roles if fqn.startswith(name + ".")), key=len, default=None)
        if owner is None or roles[owner] not in PARTIAL_SUM_ROLES:
            where = f"its experts {owner} have role {roles[owner]}" if owner else "no module around it is planned"
            raise StyleRefusal(fqn, module, style, "which makes an identity expert's output one term of its experts' "
                               f"partial sum over tp, but {where}, whose output is not such a sum")
        return "identity_share"

    def _embedding_role(self, fqn: str, module: nn.Embedding, meaning: StyleMeaning | None) -> str:
        """The model's input embedding is split by vocabulary whatever its hint says — unless
        modules of its own run inside its forward (Inkling-2's normed embedding): they would
        see the lookup's partial sums over tp, which only the module's output boundary
        reduces, so it is replicated. Another embedding is planned only from an
        embedding-kind (or replicate) hint."""
        if module is input_embeddings(self.model):
            inner = any(True for child in module.children() for _ in child.parameters())
            return "replicate" if inner else "vocab_embedding"
        if meaning is not None and meaning.sits_on in (EMBEDDING, ANY):
            return meaning.role
        raise UnclassifiedModule(_unclassified_message(fqn, module))

    def _linear_role(self, fqn: str, module: nn.Linear, meaning: StyleMeaning | None) -> str:
        """Output embedding -> lm_head; a rowwise one takes its input as its block hands it on;
        a projection that one op combines with its siblings must be split as they are."""
        if module is output_embeddings(self.model):
            return "lm_head"
        intent = self._linear_intent(fqn, module, meaning)
        if intent == _CONSUMER or intent in _CONSUMER_EXPECTS:
            return self._consumer_role(fqn, intent)
        if intent in _PRODUCER_LAYOUTS:
            self._check_group_agrees(fqn, intent)
        return intent

    def _linear_intent(self, fqn: str, module: nn.Linear, meaning: StyleMeaning | None) -> str:
        """What the linear is on its own, before its block is consulted: the role its
        linear-kind hint means, else what its name says (rowwise ones as ``_CONSUMER``)."""
        if meaning is not None and meaning.sits_on in (LINEAR, ANY):
            return meaning.role
        name = _leaf(fqn)
        if name in COLWISE_NAMES:
            return "colwise"
        if name in ROWWISE_NAMES:
            return _CONSUMER
        if name in FUSED_QKV_NAMES:
            return self._fused_qkv_role(fqn, module)
        if name in FUSED_GATE_UP_NAMES:
            return "fused_gate_up"
        if name in ROUTER_NAMES:
            return "replicate"
        raise UnclassifiedModule(_unclassified_message(fqn, module))

    def _consumer_role(self, fqn: str, intent: str) -> str:
        """rowwise after split features, rowwise_split_input after full ones; the module's own
        hint decides only where its block hands on both (or nothing)."""
        siblings = self._sibling_layouts(fqn)
        layouts = set(siblings.values())
        hinted = intent if intent in _CONSUMER_EXPECTS else None
        if hinted is not None and (not layouts or _CONSUMER_EXPECTS[hinted] in layouts):
            return hinted
        if layouts == {FULL}:
            return "rowwise_split_input"
        if layouts <= {SPLIT}:
            return "rowwise"
        rowwise_entry = ROLE_BUILDERS["rowwise"](self.model.get_submodule(fqn), {})
        raise PlanError(
            f"cannot plan {fqn}: the projections of its block hand on split features "
            f"({_names_with(siblings, SPLIT)}) and full ones ({_names_with(siblings, FULL)}), and nothing says "
            "which it reads. "
            "A TP-plan hint (rowwise: split, rowwise_split_input: full) or a plan_overrides entry decides, e.g. "
            f"{override_entry_text(fqn, rowwise_entry)}")

    def _sibling_layouts(self, fqn: str) -> dict[str, str]:
        """What each projection beside ``fqn`` hands on (split or full features), from its
        own hint or name; projections the planner cannot classify are left out."""
        parent_fqn, _, own = fqn.rpartition(".")
        parent = self.model.get_submodule(parent_fqn)
        layouts = {}
        for name, child in parent.named_children():
            if name == own or not isinstance(child, nn.Linear) or child is output_embeddings(self.model):
                continue
            child_fqn = f"{parent_fqn}.{name}" if parent_fqn else name
            try:
                intent = self._linear_intent(child_fqn, child, self._hint_meaning(child_fqn, child))
            except PlanError:
                continue  # planned (or refused, or overridden) in its own turn
            if intent in _PRODUCER_LAYOUTS:
                layouts[name] = _PRODUCER_LAYOUTS[intent]
        return layouts

    def _check_group_agrees(self, fqn: str, intent: str) -> None:
        """q, k and v feed one attention (gate and up one product): one split, one full
        cannot line up, whatever each one's hint says."""
        own = _leaf(fqn)
        group = next((g for g in _AGREEING_GROUPS if own in g), None)
        if group is None:
            return
        mine = _PRODUCER_LAYOUTS[intent]
        others = {name: layout for name, layout in self._sibling_layouts(fqn).items() if name in group}
        clashing = sorted(name for name, layout in others.items() if layout != mine)
        if clashing:
            raise PlanError(
                f"cannot plan {fqn}: it hands on {mine} features but {', '.join(clashing)} beside it "
                f"hand{'s' if len(clashing) == 1 else ''} on {others[clashing[0]]} ones, and "
                f"{', '.join(sorted(group))} are combined by one op; give them the same TP-plan style "
                "(colwise, or colwise_gather_output) or plan_overrides entries")

    def _norm_role(self, fqn: str, module: nn.Module, meaning: StyleMeaning | None) -> str:
        """A norm on a projection sees what that projection hands on: all of it when
        gathered (replicate), its heads or its slice when split (head_norm,
        projection_norm). Other norms (and routers) are replicated."""
        named = _leaf(fqn) in HEAD_NORM_NAMES
        feeders = self._feeder_layouts(fqn, module)
        if not named and not (meaning is not None and meaning.role == "head_norm" and feeders):
            return "replicate"
        layouts = set(feeders.values())
        if layouts <= {FULL}:  # gathered feeders, or none the names split (DSA's indexer k_norm after wk)
            return "replicate"
        if len(layouts) > 1:
            raise PlanError(
                f"cannot plan norm {fqn}: of the projections that may feed it, {_names_with(feeders, SPLIT)} "
                f"hand on split features and {_names_with(feeders, FULL)} full ones; give them the same "
                "TP-plan style or the norm a plan_overrides entry")
        return self._qk_norm_role(module)

    def _feeder_layouts(self, fqn: str, module: nn.Module) -> dict[str, str]:
        """The projections beside a norm that can feed it: ``<x>_proj`` (or ``<x>``) for a norm
        named ``<x>_norm``, else every one whose output is a whole number of norm widths."""
        siblings = self._sibling_layouts(fqn)
        if not siblings:
            return {}
        prefix = _leaf(fqn).removesuffix("_norm")
        named = {name: layout for name, layout in siblings.items() if name in (f"{prefix}_proj", prefix)}
        if named:
            return named
        width = _norm_width(module)
        parent = self.model.get_submodule(fqn.rpartition(".")[0])
        return {name: layout for name, layout in siblings.items()
                if width and getattr(parent, name).out_features % width == 0}

    # --- refusals -----------------------------------------------------------------------------

    def _fallback_role(self, fqn: str, module: nn.Module) -> str | None:
        """What the structure alone makes of a module whose style was refused: its role with
        the hint ignored (replicated where the structure has none; None without parameters)."""
        if not _has_own_params(module):
            return None
        try:
            return self._role(fqn, module, use_hint=False)
        except PlanError:
            return "replicate"

    def _layer_views(self) -> list:
        config = getattr(self.model, "config", None)
        return layer_views(config) if config is not None else []

    def _head_dims(self) -> set[int]:
        """The head widths the layers have (one per layer kind on a per-layer config)."""
        dims = set()
        for view in self._layer_views():
            head_dim, heads = getattr(view, "head_dim", None), getattr(view, "num_attention_heads", None)
            dims.add(head_dim or (view.hidden_size // heads if heads else None))
        return dims - {None}

    def _qk_norm_role(self, module: nn.Module) -> str:
        """Per-head norms (weight = head_dim) act on head-split tensors; a norm whose
        weight spans the whole projection needs the full projection output."""
        weight = getattr(module, "weight", None)
        if weight is not None and weight.shape[-1] not in self._head_dims():
            return "projection_norm"
        return "head_norm"

    def _fused_qkv_role(self, fqn: str, module: nn.Linear) -> str:
        sizes = {(getattr(view, "num_attention_heads", None), getattr(view, "num_key_value_heads", None))
                 for view in self._layer_views()} or {(None, None)}
        heads, kv_heads = next((pair for pair in sizes if pair[1] is not None and pair[1] != pair[0]), next(iter(sizes)))
        if module.out_features % 3 or (kv_heads is not None and kv_heads != heads):
            raise PlanError(
                f"cannot shard fused projection {fqn} ({type(module).__name__}, out_features "
                f"{module.out_features}): q/k/v parts are unequal (num_attention_heads={heads}, "
                f"num_key_value_heads={kv_heads}), so no packed_shard layout splits it; "
                "give it a fully specified plan_overrides entry")
        return "fused_qkv"

    def _module_hint(self, fqn: str) -> str | None:
        return _lookup(self.hints, fqn)

    def _head_vectors(self, fqn: str, module: nn.Module) -> tuple[list[str], bool | None]:
        """The module's own vectors with one entry per attention head (GPT-OSS's attention
        sinks, Beam's gate_bias) and whether its own query projection splits the heads
        over tp (None: no such projection found). Split ones are split with the heads
        (``colwise``: rows), as a TP plan writes them (Granite-SWA's ``self_attn.sinks:
        colwise``); in a gathered block every rank keeps every head, so they stay whole."""
        heads = {getattr(view, "num_attention_heads", None) for view in self._layer_views()} - {None}
        vectors = [name for name, p in module.named_parameters(recurse=False) if p.dim() == 1 and p.shape[0] in heads]
        if not heads or not vectors or isinstance(module, (nn.Linear, nn.Embedding)):
            return [], None
        feeding = self._attention_inputs()
        for name, child in module.named_children():
            child_fqn = f"{fqn}.{name}" if fqn else name
            if not isinstance(child, nn.Linear) or name not in ({"q_proj"} | FUSED_QKV_NAMES) and child_fqn not in feeding:
                continue
            try:
                intent = self.flow_roles.get(child_fqn) or self._linear_intent(
                    child_fqn, child, self._hint_meaning(child_fqn, child))
            except PlanError:
                continue
            return vectors, _PRODUCER_LAYOUTS.get(intent) == SPLIT
        # No projection seen feeding attention: the dataflow's layout of the module's own
        # projections still says whether its heads are split (all gathered: whole).
        layouts = {_PRODUCER_LAYOUTS.get(self.flow_roles.get(f"{fqn}.{name}" if fqn else name))
                   for name, _ in module.named_children()} - {None}
        return vectors, (False if layouts == {FULL} else None)

    def _param_hints(self, fqn: str, module: nn.Module) -> dict[str, str]:
        """TP-plan styles written on the module's parameters themselves (per-head vectors of a
        head-split attention split by default, ``_head_vectors``); a style that gives
        a parameter no layout is refused by name."""
        vectors, heads_split = self._head_vectors(fqn, module)
        found = {name: "colwise" for name in vectors} if heads_split else {}
        for name, _ in module.named_parameters(recurse=False):
            full_name = f"{fqn}.{name}" if fqn else name
            style = _lookup(self.hints, full_name)
            if style is None or heads_split is False and name in vectors:
                continue  # no hint; or a per-head vector of a gathered block: whole on every rank
            meaning = style_meaning(style)
            if meaning is None or meaning.param_layout is None:
                raise StyleRefusal(
                    fqn, module, style, f"written on its parameter {name!r}, "
                    + ("a style this planner has no meaning for" if meaning is None
                       else "which gives a parameter no layout"))
            found[name] = style
        return found


def _holds_projections(module: nn.Module) -> bool:
    """A module with parameterized children (a block, not a lone projection)."""
    return any(_has_own_params(child) for child in module.modules() if child is not module)


def _tied_twin(model: nn.Module, module: nn.Module, planned_with: dict[int, str], modules: Mapping) -> str | None:
    """The module of the same class planned before this one that holds the very same
    parameters (weights tied across layers: Zamba's shared transformer block, reached from
    several hybrid layers): the tied parameters are one tensor, so they get that module's
    entry, whatever the traced copy saw of this name. (A tied output head is a Linear
    sharing an Embedding's table: its own role, not its twin's.)"""
    own = list(module.parameters(recurse=False))
    twins = {planned_with.get(id(p)) for p in own}
    if not own or len(twins) != 1:
        return None
    twin = twins.pop()
    if twin not in modules or type(model.get_submodule(twin)) is not type(module):
        return None
    return twin


def _names_agree(named: Mapping[str, str], block) -> bool:
    """Names and hints may plan a block they classify whole if they split nothing in it (a
    gathered block is exact whatever its dataflow) or split it exactly as the dataflow
    measured it can be split; a split the dataflow found unsafe (a norm over the whole
    attention output, a reshape with the global head count) is not theirs to make."""
    flow = block.roles()
    split = [name for name, role in named.items() if _PRODUCER_LAYOUTS.get(role) == SPLIT or role == "rowwise"]
    return not split or block.mode == SPLIT_MODE and all(named[name] == flow[name] for name in split)


def _has_own_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _all_vectors(module: nn.Module) -> bool:
    """Only 1-d (or scalar) parameters: a norm's scale and shift."""
    return all(p.dim() < 2 for p in module.parameters(recurse=False))


def _leaf(fqn: str) -> str:
    return fqn.rsplit(".", 1)[-1]


def _norm_width(module: nn.Module) -> int | None:
    """The feature width a norm normalizes over: the length of its weight (or first vector)."""
    weight = getattr(module, "weight", None)
    if weight is None:
        weight = next(module.parameters(recurse=False), None)
    return int(weight.shape[-1]) if weight is not None and weight.dim() else None


def _names_with(layouts: dict[str, str], layout: str) -> str:
    return ", ".join(sorted(name for name, value in layouts.items() if value == layout))


def _layer_glob(fqn: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp``: one entry for every layer, as HF's plans are written."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", fqn)


def _named_text(named: Mapping) -> str:
    return "{" + ", ".join(f"{axis}: {placement_to_text(p)}" for axis, p in named.items()) + "}"


def _refusals_message(refusals: list[StyleRefusal], modules: Mapping[str, ShardingConfig]) -> str:
    """One paragraph per refused module pattern (every layer's copy is refused alike)."""
    paragraphs = {}
    for refusal in refusals:
        pattern = _layer_glob(refusal.fqn)
        if pattern in paragraphs:
            continue
        entry = modules.get(refusal.fqn, ShardingConfig())
        how = ("as the structure alone would" if refusal.fallback_role is None
               else f"as the structure alone would ({refusal.fallback_role})")
        paragraphs[pattern] = (f"{refusal.head}. A recipe plan_overrides entry places it instead, {how}, e.g. "
                               f"{override_entry_text(refusal.fqn, entry)}")
    return "\n".join(paragraphs.values())


def override_entry_text(fqn: str, config: ShardingConfig) -> str:
    """``config`` as a fully specified plan_overrides entry (YAML flow style) for ``fqn`` in
    every layer (layer indices written ``*``), as a recipe would hold it."""
    parts = [f"match: {_layer_glob(fqn)}",
             "params: {" + ", ".join(f"{name}: {_named_text(named)}"
                                     for name, named in config.state_shardings.items()) + "}"]
    for key in IO_PLACEMENT_FIELDS:
        value = getattr(config, key)
        if value is not None:
            items = (value,) if isinstance(value, Mapping) else value
            parts.append(f"{key}: [" + ", ".join("null" if item is None else _named_text(item)
                                                 for item in items) + "]")
    if config.local_map:
        parts.append("local_map: true")
    return "{" + ", ".join(parts) + "}"


def _axes_placed(modules: dict[str, ShardingConfig]) -> set[str]:
    """Mesh axes some entry shards a parameter or an input/output on (not only replicates)."""
    from torch.distributed.tensor import Replicate

    placed = set()
    for config in modules.values():
        named = list(config.state_shardings.values())
        for io in (getattr(config, key) for key in IO_PLACEMENT_FIELDS):
            items = [io] if isinstance(io, dict) else list(io or ())
            named.extend(entry for entry in items if isinstance(entry, dict))
        for entry in named:
            placed.update(str(axis) for axis, placement in entry.items()
                          if not isinstance(placement, Replicate) and placement != "replicate")
    return placed


def _params_text(module: nn.Module) -> str:
    return ", ".join(f"{n} {list(p.shape)}" for n, p in module.named_parameters(recurse=False))


def _unclassified_message(fqn: str, module: nn.Module) -> str:
    named = list(module.named_parameters(recurse=False))
    params = _params_text(module)
    example = ", ".join(f"{n}: {{tp: replicate}}" for n, _ in named)
    return (f"cannot classify module {fqn} ({type(module).__name__}; parameters {params}): no tensor-parallel "
            "role from its type, its name or the model's TP plan. A recipe plan_overrides entry can specify "
            f"it, with params for every parameter, e.g. {{match: {fqn}, params: {{{example}}}, local_map: true}}, "
            "or give the planner a hint")


def _lookup(hints: dict[str, str], name: str) -> str | None:
    """The style the model's TP plan gives ``name``, by the plan precedence (``name_match``:
    its exact key, else the last glob that hits it). No transformers model's TP plan has
    two globs hitting one module with different styles, so the order never decides one."""
    found = plan_entry_for(name, hints)
    return None if found is None else found[1]


def _model_tp_hints(model: nn.Module) -> dict[str, str]:
    """The model's own TP plan with FQNs from the top model (HF keeps it per base model)."""
    merged = getattr(model, "_tp_plan", None)
    if merged:
        return dict(merged)
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix):
        base = {f"{prefix}.{key}": style for key, style in base.items()}
    return {**base, **dict(getattr(type(model), "_tp_plan", None) or {})}
