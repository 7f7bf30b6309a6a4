"""derive: the planner's per-module plan on a meta-device model.

This is the one stage that imports torch and transformers.
"""

import contextlib
import copy
import gc
import itertools
from typing import Any

from hyper_parallel.codegen.spec.types import CodegenSpec
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.hf_config_keys import EXPERT_COUNT_KEYS, TOP_K_KEYS, layer_views


class DeriveError(ValueError, HyperParallelError):
    """The model cannot be built or planned; names the recipe key or module."""


def trusts_remote_code(spec: CodegenSpec) -> bool:
    """Remote code is the source codegen was pointed at (``auto_map`` in the model
    folder's config.json): the planner must see the model that code builds. It is read
    from the local folder only (``resolve`` refuses code in other repositories)."""
    return spec.source.is_remote


# Config sizes a decoder divides by or builds from: never below 1 (a zero here is a
# ZeroDivisionError or an empty model deep inside the model's code).
POSITIVE_SIZES = frozenset({"hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "head_dim",
                            "max_position_embeddings", "moe_intermediate_size", "num_experts_per_tok"})


def build_hf_config(spec: CodegenSpec, config_class: type | None = None):
    """The model folder's config with ``model.config_overrides``. ``config_class`` (a
    bundle's copy of a remote-code config class) reads config.json without running the
    model folder's code; by default the HF auto class picks the class."""
    from transformers import AutoConfig

    if config_class is not None:
        config = config_class.from_pretrained(str(spec.model_dir))
    else:
        config = AutoConfig.from_pretrained(str(spec.model_dir), trust_remote_code=trusts_remote_code(spec))
    config = text_decoder_config(config)
    per_layer = getattr(config, "per_layer_attributes", None) or set()
    for key, value in spec.config_overrides.items():
        if getattr(config, "attribute_map", {}).get(key, key) in per_layer:
            raise DeriveError(f"{spec.recipe_path}: model.config_overrides.{key}: {key} differs by layer in "
                              f"{spec.model_dir / 'config.json'} (per_layer_config), and one model-wide value would "
                              "not reach the layers that set their own; set it in per_layer_config instead")
        if not hasattr(config, key):
            raise DeriveError(f"{spec.recipe_path}: model.config_overrides.{key}: "
                              f"{type(config).__name__} has no attribute {key!r}")
        canonical = getattr(config, "attribute_map", {}).get(key, key)
        if (canonical in POSITIVE_SIZES or canonical.endswith("_heads")) and isinstance(value, int) and value < 1:
            raise DeriveError(f"{spec.recipe_path}: model.config_overrides.{key}: expected an integer >= 1 "
                              f"(config.json has {getattr(config, key)!r}), got {value!r}; fix the value or drop "
                              f"the override")
        try:
            setattr(config, key, value)
        except Exception as exc:  # transformers' strict configs validate on set (huggingface_hub's own error)
            reason = " ".join(str(exc).split())
            raise DeriveError(f"{spec.recipe_path}: model.config_overrides.{key}: {reason}") from None
    _check_config_relations(spec, config)
    return config


def text_decoder_config(config):
    """A composite (vision-language) config whose causal-LM class is its text decoder alone
    (Qwen3.5, Qwen3.5-MoE: ``AutoModelForCausalLM`` builds ``*ForCausalLM`` from
    ``text_config`` and loads the checkpoint's language-model weights, the towers' left
    out): that text config, which the plan, verify and training all see. Any other config
    as it is."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is config:
        return config
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return config
    if getattr(model_class, "config_class", None) is type(text):
        return copy.deepcopy(text)
    return config


# (smaller, larger): sizes a decoder needs in this order; the first name found on the config counts.
_SIZE_RELATIONS = ((TOP_K_KEYS, EXPERT_COUNT_KEYS),
                   (("num_key_value_heads",), ("num_attention_heads",)))


def _check_config_relations(spec: CodegenSpec, config) -> None:
    """Sizes that must not exceed each other (top-k within the experts, kv heads within the
    heads): otherwise the model's own code fails deep inside (torch.topk out of range)."""
    for (smaller_names, larger_names), view in itertools.product(_SIZE_RELATIONS, layer_views(config)):
        smaller = next((n for n in smaller_names if isinstance(getattr(view, n, None), int)), None)
        larger = next((n for n in larger_names if isinstance(getattr(view, n, None), int)), None)
        if smaller is None or larger is None or not getattr(view, larger) > 0:
            continue
        low, high = getattr(view, smaller), getattr(view, larger)
        if low > high:
            source = ("model.config_overrides" if {smaller, larger} & set(spec.config_overrides)
                      else f"{spec.model_dir / 'config.json'}")
            raise DeriveError(f"{spec.recipe_path}: {source}: {smaller} = {low} exceeds {larger} = {high}; "
                              f"expected {smaller} <= {larger}")


def build_meta_model(spec: CodegenSpec, model_class: type | None = None, *, replace: bool = True):
    """The model on the meta device (no weights), replacements applied (unless not
    ``replace``: the HF model whose checkpoint layout the weight map starts from), as
    training sees it.

    ``model_class`` defaults to the HF auto class; preflight passes the generated class
    (whose ``__init__`` applies the replacements itself). For remote code, a generated
    class brings its config class along (the bundle's copy of the sibling), so the
    bundle builds without the model folder's code being imported."""
    import torch
    from transformers import AutoModelForCausalLM

    from hyper_parallel.runtime import hyper_apply_replacements

    bundle_config_class = model_class.config_class if model_class is not None and spec.source.is_remote else None
    config = build_hf_config(spec, bundle_config_class)
    config._attn_implementation = spec.attn_implementation
    with torch.device("meta"):
        try:
            if model_class is None:
                model = AutoModelForCausalLM.from_config(config, attn_implementation=spec.attn_implementation,
                                                         trust_remote_code=trusts_remote_code(spec))
            else:
                model = model_class(config)
        except (ArithmeticError, ValueError, TypeError, IndexError, KeyError) as exc:
            raise _config_build_error(spec, config, exc) from exc
        if model_class is None and replace:
            hyper_apply_replacements(model, spec.replacements)
    return model, config


def recorded_weight_map(spec: CodegenSpec, model) -> dict[str, Any]:
    """The weight map codegen records (``distributed/weight_map.py``): from the tensors
    ``save_pretrained`` writes for the HF model, through transformers' conversion, then
    through the replacements' declared renames to ``model``'s (replaced) names; derived on
    one layer of each kind (``planning/weight_map_by_kind.py``)."""
    from hyper_parallel.planning.weight_map_by_kind import weight_map_by_kind

    if not spec.replacements:
        return weight_map_by_kind(model)
    hf_model, _ = build_meta_model(spec, replace=False)
    return weight_map_by_kind(model, hf_model)


def _config_build_error(spec: CodegenSpec, config, exc: Exception) -> Exception:
    """A model that cannot be built from the config the recipe asked for: name the
    overrides (the usual cause) rather than a bare error from deep inside its __init__."""
    if "attn_implementation" in str(exc):
        reason = str(exc).split(". ", 1)[0]
        return DeriveError(f"{spec.recipe_path}: model.attn_implementation: {type(config).__name__} cannot use "
                           f"{spec.attn_implementation!r} ({reason}); use eager or sdpa, or an implementation "
                           f"transformers registers")
    if not spec.config_overrides:
        return exc
    keys = ", ".join(f"{k}={v!r}" for k, v in spec.config_overrides.items())
    return DeriveError(f"{spec.recipe_path}: model.config_overrides ({keys}): {type(config).__name__} from "
                       f"{spec.model_dir / 'config.json'} with these overrides does not build a model: "
                       f"{type(exc).__name__}: {exc}; fix or drop the overrides")


def plan_model(model, spec: CodegenSpec):
    """The planner's result for ``model`` (replacements already applied) under the
    recipe's layout and overrides, on the layout's offline mesh. The derive
    stage and the hf backend's run-time planning both call this."""
    from hyper_parallel.planning.planner import ShardingPlanner

    # The planner reads the HF config's base_model_tp_plan itself, as role hints, merges
    # the recipe's overrides (which may specify modules it cannot classify), then lints.
    flow, flow_error = trace_dataflow(spec)
    return ShardingPlanner(model, spec.layout, overrides=spec.plan_overrides, dataflow=flow,
                           dataflow_error=flow_error).plan()


TRACE_TOKENS = 8


def trace_dataflow(spec: CodegenSpec):
    """The dataflow of the recipe's model (``planning/dataflow.py``): one forward of a
    tiny random-weight copy on CPU: the verify probe's widths and depth (the shortest
    prefix of layers holding every layer kind, so every module pattern is traced; module
    names are the model's), replacements applied, on one thread (the copy's tensors are too
    small to share out; on a busy machine a second thread's hand-offs made the trace up to ten
    times slower). Returns (Dataflow, "") or (None, why) when the copy cannot be built or
    run; the planner then goes by names and hints alone and says so where that is not enough."""
    import torch
    from transformers import AutoModelForCausalLM

    from hyper_parallel.codegen.check.probe import faithful_probe_config, shrink_widths
    from hyper_parallel.runtime import hyper_apply_replacements
    from hyper_parallel.planning.dataflow import analyze
    from hyper_parallel.planning.local_widths_dry_run import local_widths_dry_run

    p = spec.layout
    try:
        config = build_hf_config(spec)
        config._attn_implementation = spec.attn_implementation
        where = f"{spec.model_dir / 'config.json'} (dataflow trace)"
        wide = shrink_widths(config, tp=p.tp, ep=p.ep, seq_len=TRACE_TOKENS, where=where)
        split = "cp" if p.cp > 1 else "sp" if p.sequence_parallel else None
        tiny, _, _ = faithful_probe_config(wide, remote=trusts_remote_code(spec), where=where,
                                           min_depth=2 if split else 1)
        state, threads = torch.random.get_rng_state(), torch.get_num_threads()
        try:
            torch.manual_seed(0)
            torch.set_num_threads(1)  # tiny tensors: other threads add hand-offs, which a busy machine makes slow
            model = AutoModelForCausalLM.from_config(tiny, attn_implementation=spec.attn_implementation,
                                                     trust_remote_code=trusts_remote_code(spec), dtype=torch.float32)
            hyper_apply_replacements(model, spec.replacements)
            ids = torch.randint(0, tiny.vocab_size, (1, TRACE_TOKENS))
            return analyze(model, ids, tp=p.tp, dry_run=local_widths_dry_run(model, ids, p.tp),
                           sequence_split=split), ""
        finally:
            torch.random.set_rng_state(state)
            torch.set_num_threads(threads)
    except Exception as exc:  # any failure of the model's own code: plan by names and hints instead
        return None, f"the dataflow trace of a tiny copy failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def pipeline_stages(spec: CodegenSpec, model) -> tuple[tuple[int, int], ...] | None:
    """Where pp > 1, the decoder layers each pipeline stage runs (config/pipeline.py's
    split, which the trainer runs as the plan records it); a family whose stages would
    not compute what the whole model does is refused here, at generate time."""
    from hyper_parallel.config.pipeline import PipelineError, stage_split
    from hyper_parallel.distributed.pipeline import PipelineSplitError, check_stage_handoff, decoder_layer_weights

    layout = spec.layout
    if layout.pp == 1:
        return None
    try:
        check_stage_handoff(model)
        return stage_split(layout.pipeline, layout.pp, decoder_layer_weights(model))
    except (PipelineError, PipelineSplitError) as exc:
        raise DeriveError(f"{spec.recipe_path}: {exc}") from None


@contextlib.contextmanager
def collector_paused():
    """Planning and the weight map make hundreds of thousands of small objects (names,
    placeholders, boxes, rules) in a process whose heap already holds torch's and
    transformers' millions: with the cycle collector on, those bursts set off
    collections that walk that whole heap again and again (about a second of the
    235B-class recipe's derive). Nothing made here waits on the collector to be freed;
    it runs again, as it was, on the way out."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def derive_plan(spec: CodegenSpec) -> dict[str, Any]:
    from hyper_parallel.distributed.plan_format import plan_to_json

    try:
        model, _ = build_meta_model(spec)
        with collector_paused():
            result = plan_model(model, spec)
            weight_map = recorded_weight_map(spec, model)
    except RuntimeError as exc:
        if type(exc).__name__ != "AmbiguousGlobalPerLayerAttributeError":
            raise
        # transformers' heterogeneous configs (per_layer_config): sizes such as the kv heads
        # differ by layer, and reading one value for the model raises.
        reason = " ".join(str(exc).split())[:240]
        raise DeriveError(f"{spec.model_dir / 'config.json'}: the config has per-layer sizes (transformers' "
                          f"per_layer_config), which the planner and the verify probe read as one value per "
                          f"model: {reason}; such models are not supported yet") from None
    return {
        "model_class": type(model).__name__,
        "dataflow_error": result.dataflow_error,
        "notes": list(result.notes),
        "module_names": [name for name, _ in model.named_modules()],
        "weight_map": weight_map,
        "plan": plan_to_json(layout=spec.layout, applied_axes=result.applied_axes,
                             recorded_axes=result.recorded_axes, modules=result.modules, roles=result.roles,
                             pipeline_stages=pipeline_stages(spec, model)),
    }
