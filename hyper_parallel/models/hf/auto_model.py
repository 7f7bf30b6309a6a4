"""``HyperAutoModel``: the training path's model entry point.

    model = HyperAutoModel.from_pretrained(config, mesh_context=ctx)   # under torchrun
    model = HyperAutoModel.from_pretrained(config)                     # one process, unsharded

``from_pretrained`` resolves the backend, then

- gen: rank 0 generates or reuses the recipe's bundle, other ranks wait for it
  (``ensure_codegen_artifact``); every rank preflights it; the model is the bundle's
  class (``codegen_meta.json`` ``model.model_class``) with the folder's weights; with a
  mesh and ``covered.sharding_plan`` the bundle's own ``hyper_parallelize`` shards it
  (no planning at run time), otherwise the runtime planner does;
- hf: transformers' ``AutoModelForCausalLM``; with a mesh, the recipe's replacements and
  the runtime planner + applier;
- custom: the model type's ``models/common`` model, sharded by its declarative plan.

``from_config`` builds freshly initialized weights and refuses gen: a bundle needs a
prepared bundle, and only ``from_pretrained`` prepares one.
"""

import logging
import os
import warnings
from typing import Any

from torch import nn
from torch._guards import active_fake_mode

from hyper_parallel.config.schema import TrainerConfig
from hyper_parallel.distributed.mesh import MeshContext
from hyper_parallel.distributed.plan_format import unapplied_axis_warnings
from hyper_parallel.models.hf import model_builder as mb
from hyper_parallel.models.hf.backend import (
    BackendError,
    ModelingBackend,
    custom_model_module,
    resolve_modeling_backend,
)
from hyper_parallel.runtime.assembly import RuntimeOptions, apply_runtime
from hyper_parallel.runtime.bundle import prepare_bundle
from hyper_parallel.runtime.integrity import check_plan_covers
from hyper_parallel.runtime.recipe import Recipe

_LOG = logging.getLogger(__name__)


class HyperAutoModel:
    """Namespace for the two constructors; it is never instantiated."""

    def __init__(self) -> None:
        raise TypeError("use HyperAutoModel.from_pretrained(config) or HyperAutoModel.from_config(config)")

    @classmethod
    def from_pretrained(cls, config: TrainerConfig, *, mesh_context: MeshContext | None = None,
                        rank: int | None = None, timeout_s: float | None = None,
                        workspace_root: str | os.PathLike | None = None) -> nn.Module:
        """The recipe's model with the model folder's weights (if it has safetensors).

        ``rank`` defaults to ``$RANK`` (0 outside torchrun); ``timeout_s`` bounds how long
        a non-zero rank waits for rank 0's bundle; ``workspace_root`` is the pipeline
        workspace (default ``$HYPER_PARALLEL_WORKSPACE`` or ``./generated``)."""
        return _build(config, mesh_context=mesh_context, pretrained=True, rank=rank, timeout_s=timeout_s,
                      workspace_root=workspace_root)

    @classmethod
    def from_config(cls, config: TrainerConfig, *, mesh_context: MeshContext | None = None,
                    workspace_root: str | os.PathLike | None = None) -> nn.Module:
        """The recipe's model, freshly initialized (the folder's weights are not read)."""
        return _build(config, mesh_context=mesh_context, pretrained=False, rank=None, timeout_s=None,
                      workspace_root=workspace_root)


def resolve_backend_for(config: TrainerConfig, hf_config: Any) -> ModelingBackend:
    """The recipe's backend; the resolver's warnings are emitted here. They stay
    ``warnings.warn``: they are about the caller's recipe (a backend it asked for and does
    not get), which a library user filters or turns into errors like any Python warning."""
    backend, messages = resolve_modeling_backend(
        force_hf=config.model.force_hf, modeling_backend=config.modeling_backend, codegen=config.codegen,
        model_type=getattr(hf_config, "model_type", None))
    for message in messages:
        warnings.warn(f"{config.where}: {message}", UserWarning, stacklevel=4)
    return backend


def check_mesh_matches_recipe(config: TrainerConfig, mesh_context: MeshContext) -> None:
    """A model built for the recipe's layout only fits a mesh context of that layout."""
    recipe, given = config.accelerator.layout, mesh_context.layout
    differing = recipe.differences(given)
    if differing:
        raise mb.ModelBuildError(f"{config.where}: the accelerator section's layout ({recipe.describe()}) differs "
                                 f"from the mesh context's ({given.describe()}) in {', '.join(differing)}; build "
                                 f"the mesh context from the recipe: MeshContext(device_mesh, "
                                 f"config.accelerator.layout)")


def _build(config: TrainerConfig, *, mesh_context: MeshContext | None, pretrained: bool, rank: int | None,
           timeout_s: float | None, workspace_root: str | os.PathLike | None) -> nn.Module:
    if mesh_context is not None:
        check_mesh_matches_recipe(config, mesh_context)
    recipe = Recipe.load(config, workspace_root=workspace_root)  # the build's one projection and HF config
    backend = resolve_backend_for(config, recipe.hf_config)
    with_weights = mb.weights_to_load(config, pretrained)
    if backend is ModelingBackend.GEN:
        if not pretrained:
            raise BackendError(
                f"{config.where}: HyperAutoModel.from_config() does not support the gen "
                f"backend (codegen: true / modeling_backend: gen): a generated model needs a prepared "
                f"bundle, which only from_pretrained() prepares; call HyperAutoModel.from_pretrained(config), "
                f"or set modeling_backend: hf for a freshly initialized HF model")
        return _build_generated(recipe, mesh_context=mesh_context, with_weights=with_weights, rank=rank,
                                timeout_s=timeout_s)
    if backend is ModelingBackend.CUSTOM:
        return _build_custom(config, recipe.hf_config, mesh_context=mesh_context, with_weights=with_weights)
    model = mb.build_hf_model(recipe.hf_config, config, with_weights=with_weights).to(mb.run_device(config).device)
    if mesh_context is not None:
        mb.prune_for_pipeline(model, config, mesh_context)
        mb.parallelize_with_planner(model, recipe.spec, mesh_context)
    return apply_model_infrastructure(model, config, mesh_context)


def _build_custom(config: TrainerConfig, hf_config: Any, *, mesh_context: MeshContext | None,
                  with_weights: bool) -> nn.Module:
    if config.accelerator.pp_size > 1:
        raise BackendError(f"{config.where}: accelerator.pp_size {config.accelerator.pp_size}: the custom backend "
                           f"does not split into pipeline stages yet; use modeling_backend: gen (or hf), or pp_size 1")
    custom = custom_model_module(getattr(hf_config, "model_type", None))
    model = mb.build_custom_model(custom, hf_config, config, with_weights=with_weights)
    model = model.to(mb.run_device(config).device)
    if mesh_context is not None:
        mb.parallelize_custom(custom, model, config, mesh_context)
    return apply_model_infrastructure(model, config, mesh_context)


def _build_generated(recipe: Recipe, *, mesh_context: MeshContext | None, with_weights: bool, rank: int | None,
                     timeout_s: float | None) -> nn.Module:
    config, hf_config = recipe.config, recipe.hf_config
    bundle_dir, module, meta, fix = prepare_bundle(recipe.spec, rank=rank, timeout_s=timeout_s)
    if rank in (None, 0):  # what derive said, said again by a run that reuses the bundle
        for line in unapplied_axis_warnings(getattr(module, "HYPER_PARALLEL_PLAN", {}).get("recorded_axes", {})):
            _LOG.warning(f"{bundle_dir.name}: {line}")
    model_class = mb.generated_model_class(module, meta, bundle_dir)
    planned = meta.get("covered", {}).get("sharding_plan") is True
    # The per-rank loader reads safetensors; .bin weights load whole through transformers.
    # Under a fake tensor mode (dry-run --fake-tensors) no weights are read, but the model
    # is planned on the meta device all the same: its full size never exists.
    sharded_load = with_weights and mb.has_safetensors(mb.recipe_model_dir(config))
    if mesh_context is not None and planned and (sharded_load or active_fake_mode() is not None):
        # Each rank reads only its own shards: plan on the meta device, then load slices.
        model = mb.build_generated_model_sharded(model_class, hf_config, config, module, mesh_context,
                                                 weight_map=meta.get("weight_map"))
        model.hyper_weight_map = meta.get("weight_map")  # checkpoints carry it for `trainer export`
        return apply_model_infrastructure(model, config, mesh_context)
    model = mb.build_generated_model(model_class, hf_config, config, with_weights=with_weights)
    model = model.to(mb.run_device(config).device)
    if mesh_context is not None:
        mb.prune_for_pipeline(model, config, mesh_context, bundle=module if planned else None)
        if planned:
            check_plan_covers(model, module, bundle_dir, fix)
            module.hyper_parallelize(model, mesh_context)
        else:  # the bundle carries no plan: plan at run time, as the hf backend does
            mb.parallelize_with_planner(model, recipe.spec, mesh_context)
    model.hyper_weight_map = meta.get("weight_map")
    return apply_model_infrastructure(model, config, mesh_context)


def apply_model_infrastructure(model: nn.Module, config: TrainerConfig,
                               mesh_context: MeshContext | None) -> nn.Module:
    """The runtime's part after the plan, with the recipe's options (runtime/assembly.py,
    which verify applies too): activation checkpointing, ``torch.compile`` of the decoder
    layers, FSDP2 ``fully_shard`` over dp — each only when the recipe asks."""
    return apply_runtime(model, mesh_context, RuntimeOptions.of(config))
