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
    modules = merge_plan_overrides(result.modules, placement_overrides(spec), model)
    return {
        "model_class": type(model).__name__,
        "plan": {
            "format": 1,
            "mesh": {"axes": list(mesh.axis_names), "sizes": list(mesh.sizes)},
            "applied_axes": list(result.applied_axes),
            "recorded_axes": dict(result.recorded_axes),
            "modules": plan_modules_to_json(modules, result.roles),
        },
    }


_PLACEMENT_KEYS = ("params", "in_src", "in_dst", "out_src", "out_dst")


def placement_overrides(spec: CodegenSpec) -> list[dict[str, Any]]:
    """The overrides that change placements. A ``replace_module`` entry's ``module_type``
    names the module it replaces (checked when replacing), not the replacement the
    planner now sees, so it is dropped here."""
    out = []
    for entry in spec.plan_overrides:
        if not any(entry.get(key) is not None for key in _PLACEMENT_KEYS):
            continue
        out.append({**entry, "module_type": None} if entry.get("replace_module") else dict(entry))
    return out
