"""The one door from a training process to the build tool (``hyper_parallel.codegen``).

A training process needs the build tool for three things only: projecting the recipe
into the codegen spec (which names the bundle and its signature), building or reusing
the recipe's bundle when it is not current, and planning at run time for a model that
has no bundle (the hf backend, a bundle without a plan). Each function here imports
codegen when it is called, never at module level; no other module under ``runtime/``,
``models/`` or ``trainer/`` imports codegen at all (a test reads the import graph).
"""

from typing import Any

from hyper_parallel.distributed.ranks import BUNDLE_WAIT_TIMEOUT_S


def project_recipe(config: Any, workspace_root: Any = None) -> Any:
    """The recipe's ``CodegenSpec``: its layout, overrides, model source location, and
    where its bundle lives (``workspace_root`` None: ``$HYPER_PARALLEL_WORKSPACE`` or
    ``./generated``). Torch-free; the source's bytes are hashed only when asked."""
    from hyper_parallel.codegen.spec.project import project_codegen_spec

    return project_codegen_spec(config, workspace_root=workspace_root)


def recipe_hf_config(spec: Any) -> Any:
    """The model folder's HF config with ``model.config_overrides``, checked as the
    derive stage checks it (remote code included)."""
    from hyper_parallel.codegen.plan.derive import build_hf_config

    return build_hf_config(spec)


def build_bundle(spec: Any, *, rank: int | None, timeout_s: float | None) -> tuple[str, str]:
    """Rank 0 generates the recipe's bundle or reuses the current one; other ranks wait
    for it. Returns (the signature the installed bundle must have, the fix command that
    regenerates it), what the integrity checks compare and name."""
    from hyper_parallel.codegen.check.drift import fix_command
    from hyper_parallel.codegen.manager import ensure_bundle
    from hyper_parallel.codegen.spec.project import signature_from_spec

    ensure_bundle(spec, rank=rank, timeout_s=BUNDLE_WAIT_TIMEOUT_S if timeout_s is None else timeout_s)
    return signature_from_spec(spec), fix_command(spec)


def plan_at_run_time(model: Any, spec: Any) -> Any:
    """The planner's result for ``model`` (replacements applied) under the recipe's layout
    and overrides: the derive stage's own planning, for a model that has no frozen plan."""
    from hyper_parallel.codegen.plan.derive import plan_model

    return plan_model(model, spec)
