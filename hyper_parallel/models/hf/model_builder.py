"""Build a model from a recipe with one backend (hf | custom | gen), and shard it.

Each ``build_*`` returns the model on the CPU in its parameter dtype (``parameter_dtype``), with the weights
of the model folder when it holds safetensors, else freshly initialized. The
``parallelize_*`` functions shard it in place on a real mesh through the project's one
applier (``hyper_parallel.distributed.applier``).
"""

import contextlib
import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch._guards import active_fake_mode

from hyper_parallel.config.model_files import (
    LOOKED_FOR,
    ModelLocationError,
    checkpoint_files,
    has_safetensors,
    model_location,
)
from hyper_parallel.config.precision import precision_policy
from hyper_parallel.config.schema import TrainerConfig
from hyper_parallel.distributed.mesh import MeshContext
from hyper_parallel.distributed.plan_format import unapplied_axis_warnings
from hyper_parallel.distributed.weight_map import derive_weight_map, saved_layout, to_text
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.platform.device import RunDevice, resolve_run_device
from hyper_parallel.platform.host_values import outside_fake_tensors

_LOG = logging.getLogger(__name__)


class ModelBuildError(ValueError, HyperParallelError):
    """The recipe's model cannot be built; names the recipe key, file or class."""


# --- the recipe's model folder and HF config -----------------------------------------------------

def recipe_model_dir(config: TrainerConfig) -> Path:
    """``model.pretrained_model_name_or_path``: a folder (relative paths against the YAML's
    folder) or a Hub id's cached snapshot (config/model_files.py)."""
    try:
        model_dir = model_location(config).folder
    except ModelLocationError as exc:
        raise ModelBuildError(str(exc)) from None
    if not (model_dir / "config.json").is_file():
        raise ModelBuildError(f"{config.where}: model.pretrained_model_name_or_path: "
                              f"expected a folder with config.json, got {model_dir}")
    return model_dir.resolve()


def parameter_dtype(config: TrainerConfig) -> torch.dtype:
    """The dtype the built model's parameters are held in: float32 master weights under
    mixed precision (weights stored as bf16 are upcast exactly), ``model.torch_dtype``
    under ``training.mixed_precision: none`` (config/precision.py decides)."""
    name = precision_policy(config).master
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ModelBuildError(f"{config.where}: model.torch_dtype: expected a torch dtype "
                              f"name (float32, bfloat16, ...), got {name!r}")
    return dtype


def _is_remote(hf_config: Any) -> bool:
    """The model folder's own code (``auto_map``) built this config: its model needs it too."""
    return bool(getattr(hf_config, "auto_map", None))


def weights_to_load(config: TrainerConfig, pretrained: bool = True) -> bool:
    """Whether the model is built with the folder's weights: ``model.init: pretrained``
    (the default) reads them and refuses a folder that has none, naming what it looked
    for; ``model.init: random`` (or a ``from_config`` build) reads none."""
    if not pretrained or config.model.init == "random":
        return False
    model_dir = recipe_model_dir(config)
    if not checkpoint_files(model_dir):
        raise ModelBuildError(f"{config.where}: model.init is pretrained (the default), but "
                              f"{model_dir} holds no weights (looked for {LOOKED_FOR}); download the weights into "
                              f"it, or set model.init: random to train from a fresh initialization")
    return True


def load_checkpoint_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight files: safetensors (sharded too) or, where the
    folder has none, ``pytorch_model*.bin`` (read with ``weights_only``: tensors, no code)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    files = checkpoint_files(model_dir)
    safetensors = [path for path in files if path.suffix == ".safetensors"]
    for path in safetensors or files:
        state.update(load_file(str(path)) if path.suffix == ".safetensors"
                     else torch.load(path, map_location="cpu", weights_only=True))
    return state


# --- hf and gen: HF PreTrainedModel classes ---------------------------------------------------------

def build_generated_model(model_class: type, hf_config: Any, config: TrainerConfig, *,
                          with_weights: bool) -> nn.Module:
    """A generated (HF-derived) class, freshly initialized by its ``post_init`` or with the
    folder's weights.

    transformers converts checkpoints (per-expert tensors into fused experts, renamed
    keys) only for its own classes, never for "custom code" such as a generated file.
    So the checkpoint is read by the HF class, and the generated model, built on the
    meta device (no init, no memory), takes over its tensors by name (same FQNs: the
    generated file is HF's source, and replacements keep parameter names)."""
    if not with_weights:
        return model_class(hf_config).to(parameter_dtype(config)).train()
    source = build_hf_model(hf_config, config, with_weights=True)
    with torch.device("meta"):
        model = model_class(hf_config)
    try:
        model.load_state_dict(source.state_dict(), strict=True, assign=True)
    except RuntimeError as exc:
        raise ModelBuildError(f"{recipe_model_dir(config)}: the checkpoint does not fit {model_class.__module__}."
                              f"{model_class.__name__}: {exc}") from None
    _adopt_meta_buffers(model, source)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # assign gave tied parameters separate objects; tie them again
    return model.train()


def build_generated_model_sharded(model_class: type, hf_config: Any, config: TrainerConfig,
                                  module: ModuleType, mesh_context: Any,
                                  weight_map: dict[str, Any] | None = None) -> nn.Module:
    """The generated model parallelized by its bundle's ``hyper_parallelize`` on the meta
    device, then materialized with only this rank's shards read from the checkpoint,
    placed by the bundle's recorded ``weight_map`` (a bundle without one: derived at load).
    Under an active ``FakeTensorMode`` (``trainer dry-run --fake-tensors``) the shards are
    fake tensors instead and nothing is read.
    Weights transformers ties stay one parameter throughout (``tie_like_transformers``)."""
    from accelerate import init_empty_weights

    from hyper_parallel.distributed.sharded_load import materialize_and_load, materialize_as_fake

    with outside_fake_tensors():  # planned on real meta tensors, as a real run plans
        with init_empty_weights(include_buffers=False):
            model = model_class(hf_config)
        tied = tie_like_transformers(model)
        prune_for_pipeline(model, config, mesh_context, bundle=module)
        module.hyper_parallelize(model, mesh_context)
    device = run_device(config).device
    with parameters_keep_identity():
        if active_fake_mode() is not None:  # trainer dry-run --fake-tensors: shapes, no storage, no weights
            with outside_fake_tensors():
                model = model.to(parameter_dtype(config))  # on meta: fake tensors cannot be converted
            materialize_as_fake(model, device)
        else:
            materialize_and_load(model, recipe_model_dir(config), device=device, weight_map=weight_map)
            model = model.to(parameter_dtype(config))
    check_tied(model, tied, "after loading the checkpoint")
    return model.train()


def recorded_pipeline_stages(module: ModuleType) -> tuple[tuple[int, int], ...] | None:
    """The stage split a bundle's frozen plan records (None where pp is 1)."""
    from hyper_parallel.distributed.plan_format import plan_from_json

    return plan_from_json(module.HYPER_PARALLEL_PLAN, where="HYPER_PARALLEL_PLAN").pipeline_stages


def prune_for_pipeline(model: nn.Module, config: TrainerConfig, mesh_context: Any,
                       bundle: ModuleType | None = None) -> None:
    """With ``pp_size > 1``: take out of ``model`` what the other pipeline stages run
    (distributed/pipeline.py), keeping this rank's stage (its pp coordinate), split as the
    ``bundle``'s frozen plan records or, without a bundle, as ``accelerator.pipeline``
    says. Tied input and output embeddings end up as one copy on the first and one on the
    last stage; the trainer sums their gradients (``TiedEmbeddingGradients``). A family
    whose stages would not compute the whole model is refused (``check_stage_handoff``:
    the hf backend has no generate step to refuse it earlier)."""
    from hyper_parallel.config.pipeline import PipelineError, stage_split
    from hyper_parallel.distributed.pipeline import PipelineSplitError, check_stage_handoff, decoder_layer_weights
    from hyper_parallel.distributed.pipeline import prune_to_stage

    layout = config.accelerator.layout
    if layout.pp == 1:
        return
    try:
        check_stage_handoff(model)
    except PipelineSplitError as exc:
        raise ModelBuildError(f"{config.where}: {exc}") from None
    boundaries = recorded_pipeline_stages(bundle) if bundle is not None else None
    if boundaries is None:
        try:
            boundaries = stage_split(layout.pipeline, layout.pp, decoder_layer_weights(model))
        except PipelineError as exc:
            raise ModelBuildError(f"{config.where}: {exc}") from None
    prune_to_stage(model, boundaries, layout.pipeline.stages_of_rank(mesh_context.device_mesh.get_local_rank("pp"),
                                                                     layout.pp))


def tie_like_transformers(model: nn.Module) -> dict[str, str]:
    """Tie the weights transformers ties, with the model's own ``tie_weights()`` (its
    ``_tied_weights_keys`` where ``config.tie_word_embeddings``, e.g. ``lm_head.weight``
    to ``model.embed_tokens.weight``); returns ``all_tied_weights_keys`` (target -> source).

    ``post_init`` ties them, but under ``accelerate.init_empty_weights`` each parameter
    ``setattr`` registers a new meta copy, so that tie is lost. Tied before
    ``hyper_parallelize``, the names are one parameter: the applier shards it once (one
    DTensor for both) and the loader fills it from the one tensor ``save_pretrained`` wrote."""
    if not callable(getattr(model, "tie_weights", None)):
        return {}
    model.tie_weights()
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    check_tied(model, tied, "after tie_weights()")
    return tied


def check_tied(model: nn.Module, tied: dict[str, str], when: str) -> None:
    """Every tied target is its source's tensor object (else the two would train apart);
    on a pipeline stage, where both are held (a middle stage holds neither, an end stage
    under a loop schedule one of them: the trainer sums the copies' gradients)."""
    from hyper_parallel.distributed.pipeline import pruned_names

    taken_out = set(pruned_names(model))
    for target, source in tied.items():
        if {target.rpartition(".")[0], source.rpartition(".")[0]} & taken_out:
            continue
        if _tensor_named(model, target) is not _tensor_named(model, source):
            raise ModelBuildError(f"{type(model).__name__}: {target} must be the parameter {source} "
                                  f"(tie_word_embeddings / _tied_weights_keys), but they are two parameters "
                                  f"{when}")


def _tensor_named(model: nn.Module, name: str) -> Any:
    """The parameter or buffer ``name`` (transformers may tie either)."""
    owner, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, leaf)


@contextlib.contextmanager
def parameters_keep_identity():
    """``to_empty`` keeps each parameter object (``torch.utils.swap_tensors``), so a tied
    parameter stays tied. torch swaps DTensors anyway; a plain meta parameter would
    otherwise become one new parameter per module that holds it (restored on exit)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _adopt_meta_buffers(model: nn.Module, source: nn.Module) -> None:
    """Non-persistent buffers (rotary frequencies) are not in a state dict: take the
    HF model's, which were computed on a real device."""
    source_buffers = dict(source.named_buffers())
    for name, buffer in list(model.named_buffers()):
        if buffer.device.type != "meta":
            continue
        if name not in source_buffers:
            raise ModelBuildError(f"buffer {name!r} of {type(model).__name__} has no counterpart in "
                                  f"{type(source).__name__}; cannot materialize it")
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        persistent = leaf not in module._non_persistent_buffers_set
        module.register_buffer(leaf, source_buffers[name], persistent=persistent)


def build_hf_model(hf_config: Any, config: TrainerConfig, *, with_weights: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM

    if with_weights:
        model = AutoModelForCausalLM.from_pretrained(str(recipe_model_dir(config)), config=hf_config,
                                                     trust_remote_code=_is_remote(hf_config),
                                                     dtype=parameter_dtype(config),
                                                     attn_implementation=config.model.attn_implementation)
        return model.train()
    model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=_is_remote(hf_config),
                                             attn_implementation=config.model.attn_implementation,
                                             dtype=parameter_dtype(config))
    return model.train()


def generated_model_class(module: ModuleType, meta: dict[str, Any], bundle_dir: Path) -> type:
    name = meta.get("model", {}).get("model_class")
    model_class = getattr(module, name, None) if name else None
    if not isinstance(model_class, type):
        raise ModelBuildError(f"{bundle_dir / 'codegen_meta.json'}: model.model_class is {name!r}, but "
                              f"{module.__name__} defines no such class; run `doit generate`")
    return model_class


# --- custom: models/common ------------------------------------------------------------------------

def build_custom_model(custom_module: ModuleType, hf_config: Any, config: TrainerConfig, *,
                       with_weights: bool) -> nn.Module:
    """The custom model, with the folder's HF checkpoint placed by the weight map (the
    model's classes declare how HF names become theirs). It carries the HF config and
    the weight map to the HF layout, so its checkpoints export to HF files."""
    from hyper_parallel.distributed.weight_map import WeightMapError

    model = custom_module.build_custom_model(hf_config)
    source = hf_source_model(hf_config)
    try:  # derived once: the loader starts from it, the checkpoints record it
        weight_map = to_text(derive_weight_map(model, saved_layout(source), source_model=source))
    except WeightMapError as exc:
        raise ModelBuildError(f"{config.where}: {exc}") from None
    if with_weights:
        load_hf_folder(model, source, recipe_model_dir(config), weight_map=weight_map)
    model.hyper_hf_config = hf_config
    model.hyper_weight_map = weight_map
    return model.to(parameter_dtype(config)).train()


def hf_source_model(hf_config: Any) -> nn.Module:
    """The HF model of ``hf_config`` on the meta device (no memory): whose names and
    conversions an HF checkpoint of it has, the first half of a custom model's weight map."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=_is_remote(hf_config))


def load_hf_folder(model: nn.Module, source: nn.Module, model_dir: Path,
                   weight_map: dict[str, Any] | None = None) -> None:
    """A custom model filled from an HF model folder: safetensors read by slices, or
    ``pytorch_model*.bin`` files read whole, either placed by the derived weight map
    (every custom tensor filled, every HF tensor placed, or an error naming them).
    ``weight_map``: the map from the layout ``save_pretrained`` writes, where the caller
    has it (a checkpoint in another layout is mapped from its own names)."""
    from hyper_parallel.distributed.sharded_load import ShardedLoadError, load_sharded_safetensors, load_tensors

    try:
        if has_safetensors(model_dir):
            load_sharded_safetensors(model, model_dir, weight_map=weight_map, source_model=source)
        else:
            load_tensors(model, load_checkpoint_state_dict(model_dir), origin=str(model_dir), source_model=source)
    except ShardedLoadError as exc:
        raise ModelBuildError(str(exc)) from None


def load_hf_tensors(model: nn.Module, hf_config: Any, tensors: dict[str, torch.Tensor]) -> None:
    """A custom model filled from an HF model's tensors in memory (its state dict, fused
    or per-expert), by the same weight map as ``load_hf_folder``."""
    from hyper_parallel.distributed.sharded_load import load_tensors

    load_tensors(model, tensors, origin="HF state dict", source_model=hf_source_model(hf_config))


# --- sharding -------------------------------------------------------------------------------------

def parallelize_with_planner(model: nn.Module, spec: Any, mesh_context: MeshContext) -> nn.Module:
    """The runtime path for HF models: the recipe's ``replace_module`` entries, then the
    same planner + overrides the derive stage runs, applied to the real mesh. ``spec``:
    the recipe's projection (``project_codegen_spec``), made once per model build."""
    from hyper_parallel.distributed.applier import apply_sharding_plan
    from hyper_parallel.runtime import build, hyper_apply_replacements

    hyper_apply_replacements(model, spec.replacements)
    result = build.plan_at_run_time(model, spec)
    if mesh_context.device_mesh.get_rank() == 0:
        for line in unapplied_axis_warnings(result.recorded_axes):
            _LOG.warning(line)
    return apply_sharding_plan(model, result.modules, mesh_context, context_parallel=result.context_parallel,
                               roles=result.roles)


def parallelize_custom(custom_module: ModuleType, model: nn.Module, config: TrainerConfig,
                       mesh_context: MeshContext) -> nn.Module:
    layout = config.accelerator.layout
    return custom_module.parallelize_custom_model(model, mesh_context, loss_parallel=layout.loss_parallel,
                                                  enable_sp=layout.sequence_parallel,
                                                  context_parallel=layout.context_parallel)


def run_device(config: TrainerConfig) -> RunDevice:
    """Where this rank's model and every tensor of its steps live: the recipe's accelerator
    of LOCAL_RANK (``platform/device.py``); an absent one is refused there, naming the
    recipe, unless the run was told by name to use the CPU."""
    return resolve_run_device(config.accelerator.device_type, where=str(config.where))
