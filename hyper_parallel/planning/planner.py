"""The sharding planner: an HF model's structure (on the meta device) -> per-module plan.

Each module gets a role, which maps to one ``ShardingConfig`` over the ``tp`` axis
(``roles.py``). The role rules (``module_roles.py``) read a module's kind and name, its
neighbours and the model's own TP plan by what each style means; where the dataflow of a
tiny traced copy (``dataflow.py``) shows what a block does, the dataflow decides, read in
this model's names (``traced_names.py``). A style the planner does not know, or one no
role means, fails planning with the module, the style and the ``plan_overrides`` entry
that would place the module instead.

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

from torch import nn

from hyper_parallel.config.context_parallel import ContextParallel
from hyper_parallel.config.layout import Layout
from hyper_parallel.config.plan_override import PlanOverride
from hyper_parallel.distributed.mesh import ParallelDims
from hyper_parallel.distributed.model_parts import decoder_layers
from hyper_parallel.planning.dataflow import Dataflow, roles_for
from hyper_parallel.planning.expert_layout import apply_expert_layout
from hyper_parallel.planning.kind_expansion import PlacedModules, expanded
from hyper_parallel.planning.layer_kinds import LayerKinds, planning_kinds
from hyper_parallel.planning.linear_blocks import HEAD_SPLIT_ROLE, PLACED_BY_PARENT_ROLE, SPLIT_MODE
from hyper_parallel.planning.module_roles import (
    PRODUCER_LAYOUTS,
    UNPARTNERED_ROLES,
    ModuleRoles,
    StyleRefusal,
    UnclassifiedModule,
    has_own_params,
    layer_glob,
    model_tp_hints,
    params_text,
    refusals_message,
)
from hyper_parallel.planning.offline_mesh import OfflineMesh, build_offline_mesh
from hyper_parallel.planning.plan_lint import PlanError, heads_not_dividing, lint_config_divisibility, lint_plan
from hyper_parallel.planning.plan_overrides import merge_plan_overrides, overridden_modules
from hyper_parallel.planning.roles import ROLE_BUILDERS, SPLIT
from hyper_parallel.planning.sequence_layout import apply_sequence_layout
from hyper_parallel.planning.stand_ins import StandIns
from hyper_parallel.planning.traced_names import TracedNames
from hyper_parallel.protocols.axes import CP, EP, SIZE_AXES, SP, TP
from hyper_parallel.protocols.sharding import IO_PLACEMENT_FIELDS, ShardingConfig

__all__ = ["PlanError", "PlanResult", "ShardingPlanner", "merge_plan_overrides"]

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


class ShardingPlanner:
    """Plans ``model`` for one ``Layout``, kept whole: its sizes, sequence and loss parallel
    and the effective context-parallel setting are read from it where they are needed."""

    def __init__(self, model: nn.Module, layout: Layout, *, mesh: OfflineMesh | None = None,
                 hints: dict | None = None, overrides: Iterable[PlanOverride] | None = None,
                 dataflow: Dataflow | None = None, dataflow_error: str = ""):
        self.model = model
        self.layout = layout
        self.hints = hints
        self.mesh = mesh if mesh is not None else build_offline_mesh(layout.dims)  # the layout's, unless given
        self.dataflow, self.dataflow_error = dataflow, dataflow_error
        self.traced = TracedNames(model, dataflow)  # what the trace saw, in this model's names
        self.overrides = list(overrides or ())
        self.rules = ModuleRoles(model, tp=layout.tp, hints={**model_tp_hints(model), **(hints or {})},
                                 traced=self.traced)

    def plan(self) -> PlanResult:
        """The plan: one layer of each kind planned (``layer_kinds.py``) and its entries
        standing for the others; every layer planned where that saves nothing, where the
        recipe's overrides place modules, or where planning fails (to name the failure as
        the per-layer planning does)."""
        self._check_mesh()
        kinds = self._layer_kinds()
        placed = self._placed_by_kind(kinds) if kinds is not None else None
        if placed is not None:
            return self._result(placed, linted=True)
        return self._result(self._placed(), linted=False)

    def plan_every_layer(self) -> PlanResult:
        """The plan with each decoder layer planned on its own: what ``plan`` must equal."""
        self._check_mesh()
        return self._result(self._placed(), linted=False)

    def _check_mesh(self) -> None:
        """The layout's sizes are valid and the offline mesh is the layout's (its tp)."""
        self.layout.dims.validate()
        if "tp" not in self.mesh.axis_names or self.mesh.size("tp") != self.layout.tp:
            raise PlanError(f"offline mesh {dict(zip(self.mesh.axis_names, self.mesh.sizes))} does not match "
                            f"tp_size={self.layout.tp}")

    def _layer_kinds(self) -> LayerKinds | None:
        """The model's layer kinds where planning one of each saves work and means the
        same: not where a recipe override places modules (it may name one layer)."""
        if any(entry.places for entry in self.overrides):
            return None
        kinds = planning_kinds(self.model, traced=self.dataflow.classes if self.dataflow is not None else ())
        return kinds if kinds is not None and kinds.reduces else None

    def _placed_by_kind(self, kinds: LayerKinds) -> PlacedModules | None:
        """The placed modules of the view holding one layer of each kind, linted and standing
        for every layer; None where planning the view fails (the caller plans every layer)."""
        view = kinds.view(self.model)
        planner = ShardingPlanner(view, self.layout, mesh=self.mesh, hints=self.hints, overrides=self.overrides,
                                  dataflow=self.dataflow, dataflow_error=self.dataflow_error)
        try:
            placed = planner._placed()
            lint_plan(view, placed.modules, self.mesh)
        except PlanError:
            return None
        return expanded(placed, kinds)

    def _placed(self) -> PlacedModules:
        """Every module's entry and role before the recipe's overrides: the roles, the parts
        left whole, the sequence and expert layouts; refused styles raise here."""
        config = getattr(self.model, "config", None)
        # Multi-query attention's one kv head, which no tp > 1 splits: attention is left whole
        # where the dataflow shows which modules it is, and the rest of the layer split. (Other
        # head counts tp does not divide are refused: a tp that divides them exists.)
        uneven_heads = heads_not_dividing(config, self.layout.tp) if config is not None and self.layout.tp > 1 else []
        if uneven_heads != ["num_key_value_heads=1"]:
            uneven_heads = []
        self._prepare_flow()
        whole_attention = bool(uneven_heads) and bool(self._attention_parts())
        if config is not None and self.layout.cp > 1 and self.layout.context_parallel.algorithm == "ulysses":
            _ulysses_heads(config, self.layout.dims)
        lint_config_divisibility(config, self.layout.dims, whole_attention=whole_attention)
        overridden = overridden_modules(self.overrides, self.model, active_axes=self._active_axes())
        placed, refusals, unclassified = self._place_each_module(overridden)
        whole_parts = self._whole_parts(unclassified)
        if whole_attention:
            whole_parts.update({part: f"tp_size={self.layout.tp} does not divide {', '.join(uneven_heads)}, so its "
                                      "heads cannot be split" for part in self._attention_parts()})
        placed.whole_notes = self._replicate_layer_parts(whole_parts, placed, overridden)
        traced = self.traced.facts()
        with placed.placing_pass(layers_first=True):  # the layers' own entries, their blocks', what follows
            placed.gathered = apply_sequence_layout(self.model, placed.modules, placed.roles, self.layout, traced)
        placed.handoff_refusals = traced.handoff_refusals
        with placed.placing_pass():
            apply_expert_layout(self.model, placed.modules, placed.roles, ep=self.layout.ep)
        if refusals:
            raise PlanError(refusals_message(refusals, placed.modules))
        return placed

    def _result(self, placed: PlacedModules, *, linted: bool) -> PlanResult:
        """The plan of ``placed`` with the recipe's overrides merged, linted (unless
        ``linted`` already), and the notes and axes read from it."""
        modules, roles = placed.modules, placed.roles
        notes = [*placed.whole_notes, *self._gathered_attention_notes(placed.gathered),
                 *self._cp_recurrent_notes(roles, placed.handoff_refusals)]
        if any(entry.places for entry in self.overrides):
            modules = merge_plan_overrides(modules, self.overrides, self.model, active_axes=self._active_axes())
            roles.update({fqn: "override" for fqn in modules if fqn not in roles})
        if not linted:
            lint_plan(self.model, modules, self.mesh)
        applied = self._applied_axes(modules)
        return PlanResult(modules=modules, applied_axes=applied,
                          recorded_axes=self._recorded_axes(applied), roles=roles, dataflow_error=self.dataflow_error,
                          notes=tuple(notes),
                          context_parallel=self.layout.context_parallel if self.layout.cp > 1 else None)

    def _active_axes(self) -> set[str]:
        """The parallel forms a plan_overrides entry's ``when`` may name, active in this layout."""
        return self.layout.dims.active_axes(sequence_parallel=self.layout.sequence_parallel)

    def _place_each_module(self, overridden: frozenset[str]):
        """The roles pass: each module's role and entry in model order (one placing pass);
        returns the placed modules, the refused styles, and the modules no rule classifies
        inside a layer part (left whole by ``_replicate_layer_parts``)."""
        placed = PlacedModules()
        refusals: list[StyleRefusal] = []
        unclassified: dict[str, nn.Module] = {}
        planned_with: dict[int, str] = {}  # id(a parameter) -> the module first planned holding it
        with placed.placing_pass():
            for fqn, module in self.model.named_modules():
                twin = _tied_twin(self.model, module, planned_with, placed.modules)
                if twin is not None:  # the same parameters as a module planned before (Zamba's shared block)
                    placed.place(fqn, placed.roles[twin], copy.deepcopy(placed.modules[twin]))
                    continue
                planned_with.update({id(p): fqn for p in module.parameters(recurse=False)})
                try:
                    found = self._role_and_entry(fqn, module, placed.roles)
                except PlanError as err:
                    found = self._after_refusal(fqn, module, err, overridden, refusals, unclassified)
                if found is not None:
                    placed.place(fqn, *found)
        return placed, refusals, unclassified

    def _role_and_entry(self, fqn: str, module: nn.Module, roles: dict[str, str]) -> tuple[str, ShardingConfig] | None:
        """The module's role and entry by the rules; None for a module that takes none (a
        container without a role, a module placed by its parent's head_split entry)."""
        if not has_own_params(module) and self.rules.flow_roles.get(fqn) == HEAD_SPLIT_ROLE:
            return HEAD_SPLIT_ROLE, self.traced.head_split_entry(fqn, dp=self.layout.dp)
        if not has_own_params(module):
            role = self.rules.container_role(fqn, module, roles)
            return None if role is None else (role, ROLE_BUILDERS[role](module, {}))
        role = self.rules.role(fqn, module)
        if role == PLACED_BY_PARENT_ROLE:
            return None  # its parameters are placed by its parent's head_split entry
        if role == HEAD_SPLIT_ROLE:
            return role, self.traced.head_split_entry(fqn, dp=self.layout.dp)
        return role, ROLE_BUILDERS[role](module, self.rules.param_hints(fqn, module))

    def _after_refusal(self, fqn: str, module: nn.Module, err: PlanError, overridden: frozenset[str],
                       refusals: list[StyleRefusal], unclassified: dict[str, nn.Module]):
        """What a module the rules could not place gets: nothing where the recipe places it,
        the dataflow's fallback, replicate where nothing is split, a whole layer part, or the
        refused style's fallback (the refusal kept to raise); any other error raises."""
        if fqn in overridden:
            return None  # the recipe places it; merge_plan_overrides checks the entry is complete
        if not isinstance(err, StyleRefusal) and fqn in self.rules.flow_fallback:
            role = self.rules.flow_fallback[fqn]
            return role, ROLE_BUILDERS[role](module, {})
        if self._splits_no_module() or isinstance(err, StyleRefusal) and self.layout.tp == 1:
            # nothing is split per module (or nothing over tp, which the refused style is
            # about): whole weights are exact, the module needs no tensor-parallel role
            return "replicate", ROLE_BUILDERS["replicate"](module, {})
        if isinstance(err, UnclassifiedModule) and (self._layer_part(fqn, strictly_inside=True) or (
                self._layer_part(fqn) is not None and _holds_projections(module))):
            # its part of the layer is left whole below (a layer part of its own with
            # parameters besides its projections, RWKV's time-mix vectors: whole with them)
            unclassified[fqn] = module
            return None
        if not isinstance(err, StyleRefusal):
            if self.dataflow_error:
                raise PlanError(f"{err} (the planner went by names and hints only: {self.dataflow_error})")
            raise err
        refusals.append(err)
        err.fallback_role = self.rules.fallback_role(fqn, module)
        if err.fallback_role is None:
            return None
        return err.fallback_role, ROLE_BUILDERS[err.fallback_role](module, {})

    def _whole_parts(self, unclassified: dict[str, nn.Module]) -> dict[str, str]:
        """Layer part -> why it is left whole: the modules no rule classifies in it."""
        whole_parts: dict[str, str] = {}
        for fqn, module in unclassified.items():
            what = f"{layer_glob(fqn)} ({type(module).__name__}; parameters {params_text(module)})"
            part = self._layer_part(fqn)
            if what not in whole_parts.get(part, ""):
                whole_parts[part] = f"{whole_parts[part]}, {what}" if part in whole_parts else what
        return {part: f"{what} has no tensor-parallel role from its type, its name or the model's TP plan"
                for part, what in whole_parts.items()}

    def _gathered_attention_notes(self, gathered: dict[str, str]) -> list[str]:
        """The attention blocks the default algorithm could not split, one note per layer
        pattern with the first block's reason: the plan's reader sees where cp does not
        split the attention work, and why."""
        algorithm = self.layout.context_parallel.algorithm
        first: dict[str, str] = {}
        for fqn in sorted(gathered):
            first.setdefault(layer_glob(fqn), gathered[fqn])
        return [f"{block} gathered over cp: accelerator.context_parallel.algorithm is left to its default "
                f"({algorithm}), which this block cannot run: {why}; every cp rank computes its attention over the "
                f"whole sequence (exact, as gather_sequence; its work not split by cp)" for block, why in first.items()]

    def _cp_recurrent_notes(self, roles: dict[str, str], refusals: dict[str, str]) -> list[str]:
        """What cp does to the blocks reading other positions of the sequence (recurrences,
        convolutions): the state handed from rank to rank, or the block gathered, and why
        (``refusals``: the hand-off check's reasons, by module)."""
        handed = sorted({layer_glob(fqn) for fqn, role in roles.items() if role == "state_handoff"})
        notes = [f"{block} under cp: each rank runs its piece of the sequence from the state the previous cp rank "
                 "hands on (the layer's own cache protocol: recurrent state and convolution inputs), one rank "
                 "after another: exact, activations split by cp, the recurrence's work not" for block in handed]
        for block in sorted({layer_glob(fqn) for fqn, role in roles.items() if role == "gathered_block"}):
            why = next((refusals[fqn] for fqn in sorted(refusals) if layer_glob(fqn) == block), "")
            if self.layout.context_parallel.load_balance:
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
        return sorted({part for name in self.traced.attention_inputs() if (part := self._layer_part(name)) is not None})

    def _replicate_layer_parts(self, whole_parts: dict[str, str], placed: PlacedModules,
                               overridden: frozenset[str]) -> list[str]:
        """Leave these parts of every decoder layer whole: every module with parameters in
        them replicated, as transformers' own tensor parallel leaves what its plan does not
        name. A module no rule classifies (DeepSeek-V4's indexer: a matrix of its own, no
        Linear) or heads tp cannot split (one kv head) put them here. Whole weights on whole
        inputs are exact at any tp; replicating one module alone would not be, where the
        modules around it split what it reads. One placing pass per part; returns one note
        per part (part -> why) for the derive log."""
        found = decoder_layers(self.model)
        notes = []
        for part, why in sorted(whole_parts.items()):
            inside = re.compile(rf"{re.escape(found[0])}\.\d+\.{re.escape(part)}(\..+)?")
            with placed.placing_pass():
                for name, module in self.model.named_modules():
                    if inside.fullmatch(name) and has_own_params(module) and name not in overridden:
                        placed.place(name, "replicate", ROLE_BUILDERS["replicate"](module, {}))
            notes.append(f"{found[0]}.*.{part} replicated whole over tp: {why}; a plan_overrides entry can place "
                         "it instead")
        return notes

    def _splits_no_module(self) -> bool:
        """tp 1 and cp 1 (dp, or ep with nothing tensor-parallel): every module keeps its
        whole weights and whole sequence, so no module needs a role to be planned."""
        return self.layout.tp == 1 and self.layout.cp == 1 and not self.layout.sequence_parallel

    def _requested_axes(self) -> set[str]:
        requested = {name for name in SIZE_AXES if name != TP and getattr(self.layout.dims, name) > 1}
        if self.layout.sequence_parallel:
            requested.add("sp")
        if self.layout.loss_parallel:
            requested.add("loss_parallel")
        return requested

    def _applied_axes(self, modules: dict[str, ShardingConfig]) -> list[str]:
        """An axis counts as applied only if it has more than one rank and some plan entry
        places something on it (sp and loss parallel ride on tp)."""
        placed = {axis for axis in _axes_placed(modules) if getattr(self.layout.dims, axis, 1) > 1}
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
            named = {name: self.rules.named_role(name, modules[name]) if name in modules else None
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
                             if norm in modules and self.rules.named_role(norm, modules[norm]) == "replicate"
                             and all(PRODUCER_LAYOUTS.get(named.get(f)) == SPLIT for f in feeders)}
        stand_ins = StandIns(self.dataflow.roles())
        standalone = StandIns(self.dataflow.standalone)
        routers = StandIns(self.dataflow.routers)
        in_blocks = StandIns({member for block in self.dataflow.blocks for member in block.members})
        for name, role in by_name.items():
            decided = any(other in flow_decided for other in stand_ins(name))
            # A module the trace saw joined to no other projection (its output read whole)
            # whose name alone would split it with no partner (Inkling-2's o_proj.gate_proj,
            # "colwise" by its name, against a whole attention output): the dataflow decides.
            decided = decided or bool(standalone(name)) and name in modules and self.rules.named_role(
                name, modules[name]) in UNPARTNERED_ROLES
            # A projection outside every block that the trace saw pick experts is a router,
            # replicated, whatever its name says (ZAYA's router MLP ends in out_proj, "rowwise"
            # by name beside fc1's split). (A block member whose output only reaches a router
            # through the stream, as attention's o_proj can, keeps its block's plan.)
            decided = decided or bool(routers(name)) and not in_blocks(name)
            (self.rules.flow_roles if decided else self.rules.flow_fallback)[name] = role
        if self.layout.tp > 1 and split_inside:
            split = StandIns(split_inside)
            self.rules.flow_roles.update({name: "head_norm" for name in modules if split(name)})


def _holds_projections(module: nn.Module) -> bool:
    """A module with parameterized children (a block, not a lone projection)."""
    return any(has_own_params(child) for child in module.modules() if child is not module)


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
    split = [name for name, role in named.items() if PRODUCER_LAYOUTS.get(role) == SPLIT or role == "rowwise"]
    return not split or block.mode == SPLIT_MODE and all(named[name] == flow[name] for name in split)


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
