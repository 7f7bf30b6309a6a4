"""The planner's role rules: what each module of an HF model is over ``tp``.

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

The planner (``planner.py``) asks ``ModuleRoles`` for each module's role; ``traced_names.py``
supplies what the dataflow saw, in the model's names.
"""

import re
from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Replicate

from hyper_parallel.distributed.model_parts import input_embeddings, output_embeddings
from hyper_parallel.distributed.name_match import plan_entry_for
from hyper_parallel.hf_config_keys import layer_views
from hyper_parallel.planning.plan_lint import PlanError
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
from hyper_parallel.planning.traced_names import TracedNames
from hyper_parallel.protocols.placements import placement_to_text
from hyper_parallel.protocols.sharding import IO_PLACEMENT_FIELDS, ShardingConfig

# What a projection hands on to the next op of its block: this rank's features or all of them.
# Split roles exact only beside a partner (a colwise producer's split output needs a rowwise
# consumer, and the other way round); gathered and split-input ones are exact on their own.
UNPARTNERED_ROLES = frozenset({"colwise", "rowwise", "fused_qkv", "fused_gate_up"})
PRODUCER_LAYOUTS = {"colwise": SPLIT, "fused_qkv": SPLIT, "fused_gate_up": SPLIT, "colwise_by_parent": SPLIT,
                    "colwise_gathered": FULL}
# What a rowwise projection expects, by role.
_CONSUMER_EXPECTS = {"rowwise": SPLIT, "rowwise_split_input": FULL}
_CONSUMER = "rowwise (input as its block hands it on)"  # a rowwise by name, role from its block
# Projections one op combines (attention scores and values; gate * up): split alike or not at all.
_AGREEING_GROUPS = (frozenset({"q_proj", "k_proj", "v_proj"}), frozenset({"gate_proj", "up_proj"}),
                    frozenset({"w1", "w3"}))


class UnclassifiedModule(PlanError):
    """A module with parameters that no rule gives a role: not its type, its name, the
    model's TP plan or the dataflow. Inside a decoder layer its part of the layer is left
    whole (``ShardingPlanner._replicate_layer_parts``); elsewhere it is refused."""


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


class ModuleRoles:
    """The role rules for one model (module docstring). ``flow_roles``: the roles the
    dataflow decides (blocks the names and hints do not classify whole), which win;
    ``flow_fallback``: the dataflow's roles where names and hints give none. The planner
    fills both (``ShardingPlanner._prepare_flow``) before it asks for roles."""

    def __init__(self, model: nn.Module, *, tp: int, hints: dict[str, str], traced: TracedNames):
        self.model = model
        self.tp = tp
        self.hints = hints  # the model's TP plan, and the caller's hints on top
        self.traced = traced
        self.flow_roles: dict[str, str] = {}
        self.flow_fallback: dict[str, str] = {}

    def role(self, fqn: str, module: nn.Module, *, use_hint: bool = True) -> str:
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
        hints = self.param_hints(fqn, module)
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

    def container_role(self, fqn: str, module: nn.Module, roles: dict[str, str]) -> str | None:
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
        if self.tp == 1:
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
        if intent in PRODUCER_LAYOUTS:
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
            if intent in PRODUCER_LAYOUTS:
                layouts[name] = PRODUCER_LAYOUTS[intent]
        return layouts

    def _check_group_agrees(self, fqn: str, intent: str) -> None:
        """q, k and v feed one attention (gate and up one product): one split, one full
        cannot line up, whatever each one's hint says."""
        own = _leaf(fqn)
        group = next((g for g in _AGREEING_GROUPS if own in g), None)
        if group is None:
            return
        mine = PRODUCER_LAYOUTS[intent]
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

    def named_role(self, fqn: str, module: nn.Module) -> str | None:
        try:
            return self.role(fqn, module)
        except PlanError:
            return None

    def fallback_role(self, fqn: str, module: nn.Module) -> str | None:
        """What the structure alone makes of a module whose style was refused: its role with
        the hint ignored (replicated where the structure has none; None without parameters)."""
        if not has_own_params(module):
            return None
        try:
            return self.role(fqn, module, use_hint=False)
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
        feeding = self.traced.attention_inputs()
        for name, child in module.named_children():
            child_fqn = f"{fqn}.{name}" if fqn else name
            if not isinstance(child, nn.Linear) or name not in ({"q_proj"} | FUSED_QKV_NAMES) and child_fqn not in feeding:
                continue
            try:
                intent = self.flow_roles.get(child_fqn) or self._linear_intent(
                    child_fqn, child, self._hint_meaning(child_fqn, child))
            except PlanError:
                continue
            return vectors, PRODUCER_LAYOUTS.get(intent) == SPLIT
        # No projection seen feeding attention: the dataflow's layout of the module's own
        # projections still says whether its heads are split (all gathered: whole).
        layouts = {PRODUCER_LAYOUTS.get(self.flow_roles.get(f"{fqn}.{name}" if fqn else name))
                   for name, _ in module.named_children()} - {None}
        return vectors, (False if layouts == {FULL} else None)

    def param_hints(self, fqn: str, module: nn.Module) -> dict[str, str]:
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


def has_own_params(module: nn.Module) -> bool:
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


def layer_glob(fqn: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp``: one entry for every layer, as HF's plans are written."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", fqn)


def _named_text(named: Mapping) -> str:
    return "{" + ", ".join(f"{axis}: {placement_to_text(p)}" for axis, p in named.items()) + "}"


def refusals_message(refusals: list[StyleRefusal], modules: Mapping[str, ShardingConfig]) -> str:
    """One paragraph per refused module pattern (every layer's copy is refused alike)."""
    paragraphs = {}
    for refusal in refusals:
        pattern = layer_glob(refusal.fqn)
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
    parts = [f"match: {layer_glob(fqn)}",
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


def params_text(module: nn.Module) -> str:
    return ", ".join(f"{n} {list(p.shape)}" for n, p in module.named_parameters(recurse=False))


def _unclassified_message(fqn: str, module: nn.Module) -> str:
    named = list(module.named_parameters(recurse=False))
    params = params_text(module)
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


def model_tp_hints(model: nn.Module) -> dict[str, str]:
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
