"""derive: the planner's per-module plan on a meta-device model (DESIGN §4, §5).

This is the one stage that imports torch and transformers.
"""

from typing import Any

from hyper_parallel.codegen.spec.types import CodegenSpec


class DeriveError(ValueError):
    """The model cannot be built or planned; names the recipe key or module."""


def build_hf_config(spec: CodegenSpec):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(spec.model_dir))
    for key, value in spec.config_overrides.items():
        if not hasattr(config, key):
            raise DeriveError(f"{spec.recipe_path}: model.config_overrides.{key}: "
                              f"{type(config).__name__} has no attribute {key!r}")
        setattr(config, key, value)
    return config


def build_meta_model(spec: CodegenSpec, model_class: type | None = None):
    """The model on the meta device (no weights), replacements applied, as training sees it.

    ``model_class`` defaults to the HF auto class; preflight passes the generated class
    (whose ``__init__`` applies the replacements itself)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hyper_parallel.codegen.runtime import hyper_apply_replacements

    config = build_hf_config(spec)
    config._attn_implementation = spec.attn_implementation
    with torch.device("meta"):
        if model_class is None:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=spec.attn_implementation)
            hyper_apply_replacements(model, spec.replacements)
        else:
            model = model_class(config)
    return model, config


def derive_plan(spec: CodegenSpec) -> dict[str, Any]:
    from hyper_parallel.distributed.mesh import ParallelDims, build_offline_mesh
    from hyper_parallel.distributed.plan_format import plan_modules_to_json
    from hyper_parallel.distributed.planner import ShardingPlanner, merge_plan_overrides

    model, _ = build_meta_model(spec)
    p = spec.parallel
    dims = ParallelDims(dp=p.dp, cp=p.cp, tp=p.tp, ep=p.ep, pp=p.pp)
    mesh = build_offline_mesh(dims)
    # The planner reads the HF config's base_model_tp_plan itself, as role hints.
    result = ShardingPlanner(model, dims=dims, mesh=mesh, sequence_parallel=p.sequence_parallel,
                             loss_parallel=p.loss_parallel).plan()
    modules = merge_plan_overrides(result.modules, placement_overrides(spec), model,
                                   active_axes=dims.active_axes(sequence_parallel=p.sequence_parallel))
    return {
        "model_class": type(model).__name__,
        "module_names": [name for name, _ in model.named_modules()],
        "plan": {
            "format": 1,
            "mesh": {"axes": list(mesh.axis_names), "sizes": list(mesh.sizes)},
            "applied_axes": list(result.applied_axes),
            "recorded_axes": dict(result.recorded_axes),
            "modules": plan_modules_to_json(modules, result.roles),
        },
    }


def placement_overrides(spec: CodegenSpec) -> list[dict[str, Any]]:
    """The recipe's overrides as the planner takes them (same order, so error messages
    name the recipe's index). A ``replace_module`` entry's ``module_type`` names the
    module it replaces (checked when replacing), not the replacement the planner now
    sees, so it is dropped here."""
    out = []
    for entry in spec.plan_overrides:
        kept = {key: value for key, value in entry.items() if value is not None}
        if not kept.get("exact_type"):
            kept.pop("exact_type", None)
        if entry.get("replace_module"):
            kept.pop("module_type", None)
        out.append(kept)
    return out
