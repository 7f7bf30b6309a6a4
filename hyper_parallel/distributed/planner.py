"""The sharding planner: an HF model's structure (on the meta device) -> per-module plan.

Roles come from the model's own TP plan (``base_model_tp_plan`` / ``_tp_plan``, used
as hints) and, where the hints say nothing, from structure: linears named like
attention / MLP projections, the input and output embeddings, packed expert weights.
Each role maps to one ``ShardingConfig`` over the ``tp`` axis (``roles.py``).

On top of the TP roles, ``sequence_layout`` applies sequence parallel, context
parallel and loss parallel, and ``expert_layout`` expert parallel. Forms the plan does
not apply (pp: the runtime's stage splitting; dp: the trainer's FSDP2) are listed in
``recorded_axes`` with the reason.

Given the recipe's ``plan_overrides``, the planner merges them after the layouts and
before the lints, so the lints see the plan as applied; a module it cannot classify
is then no error if an override places it (the override is its whole entry).
"""

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from torch import nn

from hyper_parallel.distributed.expert_layout import apply_expert_layout
from hyper_parallel.distributed.mesh import OfflineMesh, ParallelDims
from hyper_parallel.distributed.model_parts import input_embeddings, output_embeddings
from hyper_parallel.distributed.plan_lint import PlanError, lint_config_divisibility, lint_plan
from hyper_parallel.distributed.plan_overrides import merge_plan_overrides, overridden_modules
from hyper_parallel.distributed.roles import (
    COLWISE_NAMES,
    FUSED_GATE_UP_NAMES,
    FUSED_QKV_NAMES,
    HEAD_NORM_NAMES,
    ROLE_BUILDERS,
    ROUTER_NAMES,
    ROWWISE_NAMES,
    is_packed_experts,
)
from hyper_parallel.distributed.sequence_layout import apply_sequence_layout
from hyper_parallel.protocols.sharding import ShardingConfig

__all__ = ["PlanError", "PlanResult", "ShardingPlanner", "merge_plan_overrides"]

# HF tensor-parallel styles -> our roles. Styles not listed fall back to structure.
_LINEAR_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "colwise_gather_output": "lm_head",
                  "packed_colwise": "colwise"}
_EMBEDDING_STYLES = {"embedding_rowwise": "vocab_embedding", "rowwise": "vocab_embedding"}
_ANY_STYLES = {"replicated_with_grad_allreduce": "head_norm", "moe_tp_experts": "packed_experts"}

# Forms the plan applies besides tp (sequence_layout.py: sp, cp, loss_parallel; expert_layout.py: ep).
_APPLIED = frozenset({"sp", "cp", "loss_parallel", "ep"})
_NOT_APPLIED = {
    "pp": "pipeline parallel is owned by the runtime (stage splitting), not by the plan",
    "dp": "data parallel is applied by the trainer (FSDP2 fully_shard), not by the plan",
}


@dataclass
class PlanResult:
    modules: dict[str, ShardingConfig]
    applied_axes: list[str]
    recorded_axes: dict[str, str]
    roles: dict[str, str] = field(default_factory=dict)


class ShardingPlanner:
    def __init__(self, model: nn.Module, *, dims: ParallelDims, mesh: OfflineMesh,
                 sequence_parallel: bool = False, loss_parallel: bool = False, hints: dict | None = None,
                 overrides: Iterable[Mapping] | None = None):
        self.model = model
        self.overrides = list(overrides or ())
        self.dims = dims
        self.mesh = mesh
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self.hints = {**_model_tp_hints(model), **(hints or {})}

    def plan(self) -> PlanResult:
        self.dims.validate()
        if "tp" not in self.mesh.axis_names or self.mesh.size("tp") != self.dims.tp:
            raise PlanError(f"offline mesh {dict(zip(self.mesh.axis_names, self.mesh.sizes))} does not match "
                            f"tp_size={self.dims.tp}")
        config = getattr(self.model, "config", None)
        lint_config_divisibility(config, self.dims)
        active_axes = self.dims.active_axes(sequence_parallel=self.sequence_parallel)
        overridden = overridden_modules(self.overrides, self.model, active_axes=active_axes)
        modules: dict[str, ShardingConfig] = {}
        roles: dict[str, str] = {}
        for fqn, module in self.model.named_modules():
            if not any(True for _ in module.parameters(recurse=False)):
                continue
            try:
                role = self._role(fqn, module)
                config = ROLE_BUILDERS[role](module, self._param_hints(fqn, module))
            except PlanError:
                if fqn in overridden:
                    continue  # the recipe places it; merge_plan_overrides checks the entry is complete
                raise
            roles[fqn], modules[fqn] = role, config
        apply_sequence_layout(self.model, modules, roles, cp=self.dims.cp > 1, sp=self.sequence_parallel,
                              loss_parallel=self.loss_parallel)
        apply_expert_layout(modules, roles, ep=self.dims.ep)
        if self.overrides:
            modules = merge_plan_overrides(modules, self.overrides, self.model, active_axes=active_axes)
            roles.update({fqn: "override" for fqn in modules if fqn not in roles})
        lint_plan(self.model, modules, self.mesh)
        return PlanResult(modules=modules, applied_axes=self._applied_axes(), recorded_axes=self._recorded_axes(),
                          roles=roles)

    def _requested_axes(self) -> set[str]:
        requested = {name for name in ("cp", "ep", "pp", "dp") if getattr(self.dims, name) > 1}
        if self.sequence_parallel:
            requested.add("sp")
        if self.loss_parallel:
            requested.add("loss_parallel")
        return requested

    def _applied_axes(self) -> list[str]:
        return ["tp", *sorted(self._requested_axes() & _APPLIED)]

    def _recorded_axes(self) -> dict[str, str]:
        return {name: _NOT_APPLIED[name] for name in sorted(self._requested_axes() - _APPLIED)}

    def _role(self, fqn: str, module: nn.Module) -> str:
        style = self._module_hint(fqn)
        if isinstance(module, nn.Linear) and style in _LINEAR_STYLES:
            return _LINEAR_STYLES[style]
        if isinstance(module, nn.Embedding) and style in _EMBEDDING_STYLES:
            return _EMBEDDING_STYLES[style]
        if style in _ANY_STYLES:
            return _ANY_STYLES[style]
        return self._structural_role(fqn, module)

    def _structural_role(self, fqn: str, module: nn.Module) -> str:
        name = fqn.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) and module is input_embeddings(self.model):
            return "vocab_embedding"
        if isinstance(module, nn.Linear):
            if module is output_embeddings(self.model):
                return "lm_head"
            if name in COLWISE_NAMES:
                return "colwise"
            if name in ROWWISE_NAMES:
                return "rowwise"
            if name in FUSED_QKV_NAMES:
                return self._fused_qkv_role(fqn, module)
            if name in FUSED_GATE_UP_NAMES:
                return "fused_gate_up"
        if is_packed_experts(module):
            return "packed_experts"
        if name in HEAD_NORM_NAMES:
            return self._qk_norm_role(module)
        if name in ROUTER_NAMES or all(p.dim() < 2 for p in module.parameters(recurse=False)):
            return "replicate"  # norms, routers: small, every rank needs all of it
        raise PlanError(_unclassified_message(fqn, module))

    def _head_dim(self) -> int | None:
        config = getattr(self.model, "config", None)
        head_dim = getattr(config, "head_dim", None)
        heads = getattr(config, "num_attention_heads", None)
        return head_dim or (config.hidden_size // heads if heads else None)

    def _qk_norm_role(self, module: nn.Module) -> str:
        """Per-head norms (weight = head_dim) act on head-split tensors; a norm whose
        weight spans the whole projection needs the full projection output."""
        weight = getattr(module, "weight", None)
        if weight is not None and weight.shape[-1] != self._head_dim():
            return "projection_norm"
        return "head_norm"

    def _fused_qkv_role(self, fqn: str, module: nn.Linear) -> str:
        config = getattr(self.model, "config", None)
        heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
        if module.out_features % 3 or (kv_heads is not None and kv_heads != heads):
            raise PlanError(
                f"cannot shard fused projection {fqn} ({type(module).__name__}, out_features "
                f"{module.out_features}): q/k/v parts are unequal (num_attention_heads={heads}, "
                f"num_key_value_heads={kv_heads}), so no packed_shard layout splits it; "
                "give it a fully specified plan_overrides entry")
        return "fused_qkv"

    def _module_hint(self, fqn: str) -> str | None:
        return _lookup(self.hints, fqn)

    def _param_hints(self, fqn: str, module: nn.Module) -> dict[str, str]:
        found = {}
        for name, _ in module.named_parameters(recurse=False):
            style = _lookup(self.hints, f"{fqn}.{name}" if fqn else name)
            if style is not None:
                found[name] = style
        return found


def _unclassified_message(fqn: str, module: nn.Module) -> str:
    named = list(module.named_parameters(recurse=False))
    params = ", ".join(f"{n} {list(p.shape)}" for n, p in named)
    example = ", ".join(f"{n}: {{tp: replicate}}" for n, _ in named)
    return (f"cannot classify module {fqn} ({type(module).__name__}; parameters {params}): no tensor-parallel "
            "role from its type, its name or the model's TP plan. A recipe plan_overrides entry can specify "
            f"it, with params for every parameter, e.g. {{match: {fqn}, params: {{{example}}}}}, "
            "or give the planner a hint")


def _lookup(hints: dict[str, str], name: str) -> str | None:
    if name in hints:
        return hints[name]
    for pattern, style in hints.items():
        if fnmatch.fnmatchcase(name, pattern):
            return style
    return None


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
