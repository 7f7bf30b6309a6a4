"""Read a recipe YAML into a TrainerConfig: strict keys, typed values, no side effects."""

import dataclasses
import importlib.util
import os
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from hyper_parallel.config.parallel_dims import ParallelDimsError
from hyper_parallel.config.pipeline import ZERO_BUBBLE_SCHEDULES, PipelineError
from hyper_parallel.config.plan_override import PlanOverride, PlanOverrideError, parse_plan_overrides, trusted_packages
from hyper_parallel.config.schema import (
    CP_ALGORITHMS,
    DATASET_KINDS,
    DEFAULT_CP_ALGORITHM,
    DEVICE_TYPES,
    LR_DECAYS,
    MAX_SEQ_LEN,
    MIXED_PRECISION_DTYPES,
    MODEL_INITS,
    MODELING_BACKENDS,
    SPLITTING_ALGORITHMS,
    TEXT_SAMPLE_BY,
    TOKENIZED_KINDS,
    TORCH_DTYPES,
    ModelConfig,
    TrainerConfig,
)
from hyper_parallel.errors import HyperParallelError


class RecipeError(ValueError, HyperParallelError):
    """A recipe that cannot be used; the message names the file and the key."""


MAX_NPROC_PER_NODE = 1024  # ranks one host starts: its accelerators (or CPU processes)
MAX_NNODES = 65536
MAX_RECIPE_BYTES = 1 << 20  # a recipe is a page of settings; a megabyte is a mistake


class _RecipeLoader(yaml.SafeLoader):
    """YAML as a recipe needs it: no anchors or aliases (an alias bomb expands without
    bound, and a recipe has nothing to repeat), and no key given twice in one mapping
    (YAML's last-one-wins would silently drop the first value)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent) or getattr(self.peek_event(), "anchor", None):
            event = self.peek_event()
            what = "alias *" if isinstance(event, yaml.AliasEvent) else "anchor &"
            raise yaml.constructor.ConstructorError(
                None, None, f"{what}{event.anchor}: recipes take no anchors or aliases; write the value out",
                event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping (first {seen[key]}); keep one",
                    key_node.start_mark)
            seen[key] = f"line {key_node.start_mark.line + 1}"
        return super().construct_mapping(node, deep=deep)


def load_training_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> TrainerConfig:
    """Parse and validate the recipe at ``path``, with ``overrides`` (``--set KEY=VALUE``,
    ``apply_overrides``) applied before validation, so a key or value they get wrong is
    refused as the recipe's would be. Never writes anything."""
    yaml_path = Path(path).resolve()
    try:
        if yaml_path.is_dir():
            raise RecipeError(f"{path}: is a folder; expected a recipe YAML file (e.g. {Path(path) / 'recipe.yaml'})")
        size = yaml_path.stat().st_size
        if size > MAX_RECIPE_BYTES:
            raise RecipeError(f"{path}: {size} bytes; a recipe may have at most {MAX_RECIPE_BYTES} "
                              f"(is this the right file?)")
        text = yaml_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"{path}: recipe file not found") from None
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save the recipe as UTF-8") \
            from None
    try:
        data = yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: malformed YAML: {exc}") from None
    if not isinstance(data, dict):
        got = "an empty document" if data is None else type(data).__name__
        raise RecipeError(f"{path}: expected a mapping at the top level, got {got}")
    apply_overrides(data, overrides, str(path))
    plan = data.pop("plan_overrides", [])
    config = _build(TrainerConfig, data, str(path), "")
    config.plan_overrides = _plan_overrides(plan, config.model, str(path))
    config._yaml_path = str(yaml_path)
    config._written_keys = frozenset(_dotted_keys(data))
    config._overrides = tuple(overrides)
    validate_training_config(config, str(path))
    return config


def apply_overrides(data: dict, overrides: Sequence[str], where: str) -> None:
    """``KEY=VALUE`` items (``training.steps=3``, ``accelerator.tp_size=2``,
    ``training.checkpoint.dir=null``) set into the recipe's mapping; VALUE is read as YAML
    (numbers, booleans, null, lists). A malformed item, or a key under a value that is not a
    section, is refused naming it; unknown keys and wrong types are the schema's to refuse."""
    for item in overrides:
        key, equals, text = item.partition("=")
        parts = key.strip().split(".")
        if not equals or not all(part.strip() for part in parts):
            raise RecipeError(f"{where}: --set {item!r}: expected KEY=VALUE with a dotted key, e.g. "
                              f"--set training.steps=3")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise RecipeError(f"{where}: --set {item!r}: the value is not YAML: {exc}") from None
        section = data
        for depth, part in enumerate(parts[:-1]):
            section = section.setdefault(part, {})
            if not isinstance(section, dict):
                raise RecipeError(f"{where}: --set {item!r}: {'.'.join(parts[:depth + 1])} is a value, not a "
                                  f"section with keys")
        section[parts[-1]] = value


def _dotted_keys(data: dict, prefix: str = "") -> list[str]:
    """Every key of a nested mapping as a dotted path (``training.checkpoint.dir``)."""
    keys = []
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        keys.append(dotted)
        if isinstance(value, dict):
            keys.extend(_dotted_keys(value, f"{dotted}."))
    return keys


def validate_training_config(config: TrainerConfig, where: str) -> None:
    acc = config.accelerator
    if acc.device_type not in DEVICE_TYPES:
        raise RecipeError(f"{where}: accelerator.device_type: expected one of "
                          f"{', '.join(DEVICE_TYPES)}, got {acc.device_type!r}")
    try:
        acc.parallel_dims
    except ParallelDimsError as exc:
        raise RecipeError(f"{where}: {exc}") from None
    for key in ("nproc_per_node", "nnodes", "check_timeout_s"):
        if getattr(acc, key) < 1:
            raise RecipeError(f"{where}: accelerator.{key}: expected an integer >= 1, got {getattr(acc, key)}")
    for key, most in (("nproc_per_node", MAX_NPROC_PER_NODE), ("nnodes", MAX_NNODES), ("check_timeout_s", 3600)):
        if getattr(acc, key) > most:
            raise RecipeError(f"{where}: accelerator.{key}: expected at most {most}, got {getattr(acc, key)}")
    launched = acc.nproc_per_node * acc.nnodes
    if acc.world_size != launched:
        raise RecipeError(
            f"{where}: accelerator: dp_size*cp_size*tp_size*pp_size = {acc.world_size} must equal "
            f"nproc_per_node*nnodes = {launched}")
    _validate_context_parallel(config, where)
    _refuse_keys_without_effect(config, where)
    try:
        acc.layout  # the pipeline settings are checked where they are made
    except PipelineError as exc:
        raise RecipeError(f"{where}: {exc}") from None
    if config.modeling_backend is not None and config.modeling_backend not in MODELING_BACKENDS:
        raise RecipeError(f"{where}: modeling_backend: expected one of {', '.join(MODELING_BACKENDS)}, "
                          f"got {config.modeling_backend!r}")
    if config.model.init not in MODEL_INITS:
        raise RecipeError(f"{where}: model.init: expected one of {', '.join(MODEL_INITS)} (pretrained: the "
                          f"folder's weights; random: a fresh initialization), got {config.model.init!r}")
    if config.model.torch_dtype not in TORCH_DTYPES:
        raise RecipeError(f"{where}: model.torch_dtype: expected one of {', '.join(TORCH_DTYPES)}, "
                          f"got {config.model.torch_dtype!r}")
    _validate_training(config, where)
    _validate_dataset(config, where)


def _validate_context_parallel(config: TrainerConfig, where: str) -> None:
    """``accelerator.context_parallel``: a known algorithm, one this version implements.
    Left out, the algorithm is the default (allgather_kv): the attention implementation it
    does not wrap is then the planner's to gather, not a refusal here."""
    key = "accelerator.context_parallel.algorithm"
    chosen = config.accelerator.context_parallel
    if chosen.algorithm is not None and chosen.algorithm not in CP_ALGORITHMS:
        raise RecipeError(f"{where}: {key}: expected one of {', '.join(CP_ALGORITHMS)}, got {chosen.algorithm!r}; "
                          f"e.g. algorithm: allgather_kv")
    algorithm = chosen.algorithm or DEFAULT_CP_ALGORITHM
    cp, seq_len = config.accelerator.cp_size, config.training.seq_len
    if algorithm == "allgather_kv" and cp > 1 and chosen.load_balance and seq_len % (2 * cp):
        default = "" if chosen.algorithm else f" (true by default, with {key}'s default {DEFAULT_CP_ALGORITHM})"
        raise RecipeError(f"{where}: accelerator.context_parallel.load_balance{default}: the sequence is cut into "
                          f"2*cp_size = {2 * cp} chunks, but training.seq_len is {seq_len}; use a multiple of "
                          f"{2 * cp}, or load_balance: false")
    attention = config.model.attn_implementation
    if chosen.algorithm in SPLITTING_ALGORITHMS and cp > 1 and attention not in ("eager", "sdpa"):
        raise RecipeError(f"{where}: {key}: {algorithm} wraps the eager or sdpa attention, but "
                          f"model.attn_implementation is {attention!r}; set model.attn_implementation: sdpa (or "
                          f"eager), or {key}: gather_sequence")


def _refuse_keys_without_effect(config: TrainerConfig, where: str) -> None:
    """A parallel key the layout makes a no-op: refused, naming it and why, so a
    recipe never reads as doing what it does not. Keys left at their defaults pass."""
    acc, written = config.accelerator, config._written_keys
    for key, what in (("sequence_parallel", "splits the tensor-parallel ranks' activations along the sequence"),
                      ("loss_parallel", "computes the loss on the vocabulary shards of the tensor-parallel ranks")):
        if getattr(acc, key) and acc.tp_size == 1:
            raise RecipeError(f"{where}: accelerator.{key}: true has no effect with tp_size 1 (it {what}); "
                              f"set accelerator.tp_size > 1, or remove {key}")
    cp_keys = sorted(k for k in written if k.startswith("accelerator.context_parallel."))
    if cp_keys and acc.cp_size == 1:
        raise RecipeError(f"{where}: {cp_keys[0]}: has no effect with cp_size 1 (no sequence is split); "
                          f"set accelerator.cp_size > 1, or remove accelerator.context_parallel")
    pp_keys = sorted(k for k in written if k.startswith("accelerator.pipeline."))
    if pp_keys and acc.pp_size == 1:
        raise RecipeError(f"{where}: {pp_keys[0]}: has no effect with pp_size 1 (the model is not split into "
                          f"stages); set accelerator.pp_size > 1, or remove accelerator.pipeline")
    algorithm = acc.context_parallel.algorithm or DEFAULT_CP_ALGORITHM
    if "accelerator.context_parallel.load_balance" in written and algorithm != "allgather_kv":
        raise RecipeError(f"{where}: accelerator.context_parallel.load_balance: applies to algorithm allgather_kv "
                          f"only (its chunk order), but algorithm is {algorithm!r}; remove "
                          f"load_balance, or set algorithm: allgather_kv")


def _validate_pipeline_schedule(config: TrainerConfig, where: str) -> None:
    """What torch's schedules ask of the run: zero-bubble schedules take each stage's
    backward apart (the input's gradient first, the weights' later, by the autograd graph
    of each parameter), which FSDP2's gathered parameters do not have; DualPipeV needs as
    many micro-batches as stages."""
    acc, training = config.accelerator, config.training
    schedule = acc.pipeline.schedule
    if acc.pp_size == 1:
        return
    if schedule in ZERO_BUBBLE_SCHEDULES and acc.dp_size > 1:
        raise RecipeError(f"{where}: accelerator.pipeline.schedule: {schedule} computes the weights' gradients apart "
                          f"from the inputs', which FSDP2 over dp (dp_size {acc.dp_size}) does not allow yet; use "
                          f"interleaved_1f1b (or 1f1b), or dp_size 1")
    microbatches = training.global_batch_size // (training.micro_batch_size * acc.dp_size)
    stages = acc.layout.pipeline.stages(acc.pp_size)
    if schedule == "dualpipev" and microbatches < stages:
        raise RecipeError(f"{where}: training.global_batch_size: dualpipev needs at least as many micro-batches per "
                          f"step as stages ({stages}), got global_batch_size {training.global_batch_size} / "
                          f"(micro_batch_size {training.micro_batch_size} x dp_size {acc.dp_size}) = {microbatches}; "
                          f"set global_batch_size >= {stages * training.micro_batch_size * acc.dp_size}")


def _plan_overrides(data: Any, model: ModelConfig, where: str) -> tuple[PlanOverride, ...]:
    """The entries typed and checked, once (config/plan_override.py does every check);
    ``model.trusted_modules`` decides which replace_module targets may run."""
    try:
        return parse_plan_overrides(data, trusted=trusted_packages(model.trusted_modules))
    except PlanOverrideError as exc:
        raise RecipeError(f"{where}: {exc}") from None


def _validate_training(config: TrainerConfig, where: str) -> None:
    training, optimizer = config.training, config.optimizer
    for key, least in (("steps", 1), ("global_batch_size", 1), ("micro_batch_size", 1), ("log_every", 1),
                       ("seq_len", 2)):  # next-token loss needs two tokens
        if getattr(training, key) < least:
            raise RecipeError(f"{where}: training.{key}: expected an integer >= {least}, "
                              f"got {getattr(training, key)}")
    if training.seq_len > MAX_SEQ_LEN:
        raise RecipeError(f"{where}: training.seq_len: expected at most {MAX_SEQ_LEN}, got {training.seq_len}")
    per_step = training.micro_batch_size * config.accelerator.dp_size
    if training.global_batch_size % per_step:
        raise RecipeError(f"{where}: training.global_batch_size: expected a multiple of micro_batch_size * dp_size "
                          f"= {training.micro_batch_size} * {config.accelerator.dp_size} = {per_step}, got "
                          f"{training.global_batch_size}")
    _validate_pipeline_schedule(config, where)
    if training.max_grad_norm is not None and not training.max_grad_norm > 0:
        raise RecipeError(f"{where}: training.max_grad_norm: expected a number > 0 (or null: no clipping), "
                          f"got {training.max_grad_norm}")
    _validate_checkpoint(config, where)
    _validate_mixed_precision(config, where)
    _validate_metrics(config, where)
    _validate_schedule_and_eval(config, where)
    if optimizer.name.lower() != "adamw":
        raise RecipeError(f"{where}: optimizer.name: expected 'adamw' (the one optimizer the trainer builds), got "
                          f"{optimizer.name!r}; set optimizer.name: adamw")
    if not optimizer.lr > 0:
        raise RecipeError(f"{where}: optimizer.lr: expected a number > 0, got {optimizer.lr}")
    if optimizer.weight_decay < 0:
        raise RecipeError(f"{where}: optimizer.weight_decay: expected a number >= 0, got {optimizer.weight_decay}")
    if len(optimizer.betas) != 2 or not all(0 <= beta < 1 for beta in optimizer.betas):
        raise RecipeError(f"{where}: optimizer.betas: expected two numbers in [0, 1), got {optimizer.betas}")


def _validate_mixed_precision(config: TrainerConfig, where: str) -> None:
    """``training.mixed_precision``: a mapping of known dtypes, or the string ``none``."""
    key = "training.mixed_precision"
    setting = config.training.mixed_precision
    if isinstance(setting, str):
        if setting != "none":
            raise RecipeError(f"{where}: {key}: expected a mapping {{param_dtype, reduce_dtype}} or 'none' (train "
                              f"in model.torch_dtype throughout), got {setting!r}")
        return
    for name in ("param_dtype", "reduce_dtype"):
        value = getattr(setting, name)
        if value is not None and value not in MIXED_PRECISION_DTYPES:
            raise RecipeError(f"{where}: {key}.{name}: expected one of {', '.join(MIXED_PRECISION_DTYPES)}, got "
                              f"{value!r}")


def _validate_schedule_and_eval(config: TrainerConfig, where: str) -> None:
    """``training.lr_schedule`` and ``training.eval``: values in range, and no key that
    would change nothing (a floor without decay, evaluation of a file's bytes)."""
    training, key = config.training, "training.lr_schedule"
    schedule = training.lr_schedule
    if not 0 <= schedule.warmup_steps <= training.steps:
        raise RecipeError(f"{where}: {key}.warmup_steps: expected an integer in [0, training.steps = "
                          f"{training.steps}] (the lr would never reach optimizer.lr), got {schedule.warmup_steps}")
    if schedule.decay not in LR_DECAYS:
        raise RecipeError(f"{where}: {key}.decay: expected one of {', '.join(LR_DECAYS)}, got {schedule.decay!r}")
    if not 0 <= schedule.min_lr_ratio <= 1:
        raise RecipeError(f"{where}: {key}.min_lr_ratio: expected a number in [0, 1] (the final lr as a fraction "
                          f"of optimizer.lr), got {schedule.min_lr_ratio}")
    if f"{key}.min_lr_ratio" in config._written_keys and schedule.decay == "constant":
        raise RecipeError(f"{where}: {key}.min_lr_ratio: has no effect with decay constant (the lr stays at "
                          f"optimizer.lr after the warmup); set decay: cosine or linear, or remove min_lr_ratio")
    evaluation = training.eval
    if evaluation is None:
        return
    for name in ("every_steps", "batches"):
        if getattr(evaluation, name) < 1:
            raise RecipeError(f"{where}: training.eval.{name}: expected an integer >= 1, got "
                              f"{getattr(evaluation, name)}")
    if config.dataset.kind == "bytes":
        raise RecipeError(f"{where}: training.eval: dataset.kind bytes (a smoke test on a file's bytes) has no "
                          f"held-out split; remove training.eval, or train on kind text, jsonl or parquet")


def _validate_metrics(config: TrainerConfig, where: str) -> None:
    """``training.metrics``: a positive peak, and TensorBoard importable when a folder is named
    (found by its spec, not imported: loading a recipe imports no heavy package)."""
    metrics, key = config.training.metrics, "training.metrics"
    if metrics.peak_flops_per_s is not None and not metrics.peak_flops_per_s > 0:
        raise RecipeError(f"{where}: {key}.peak_flops_per_s: expected the accelerator's peak FLOP/s per rank, a "
                          f"number > 0 (e.g. 989.0e12 for an H100's dense bf16), got {metrics.peak_flops_per_s}")
    if metrics.tensorboard_dir is not None:
        if not metrics.tensorboard_dir.strip():
            raise RecipeError(f"{where}: {key}.tensorboard_dir: expected a folder (relative to the recipe's folder), "
                              f"got an empty string; name a folder, or leave the key out")
        if importlib.util.find_spec("tensorboard") is None:
            raise RecipeError(f"{where}: {key}.tensorboard_dir: TensorBoard is not installed; "
                              f'pip install -c constraints.txt -e ".[metrics]", or leave the key out')


def _validate_checkpoint(config: TrainerConfig, where: str) -> None:
    """``training.checkpoint``: values only; whether ``dir`` is usable is the trainer's
    check (generate never touches checkpoints)."""
    checkpoint = config.training.checkpoint
    key = "training.checkpoint"
    if checkpoint.dir is not None and not checkpoint.dir.strip():
        raise RecipeError(f"{where}: {key}.dir: expected a folder path (relative to the recipe's folder), got an "
                          f"empty string; name a folder, or leave {key} out to save no checkpoints")
    if checkpoint.every_steps < 1:
        raise RecipeError(f"{where}: {key}.every_steps: expected an integer >= 1, got {checkpoint.every_steps}; "
                          f"e.g. every_steps: 100 saves after steps 100, 200, ... and after the last step")
    if checkpoint.keep_last < 0:
        raise RecipeError(f"{where}: {key}.keep_last: expected an integer >= 0 (0 keeps every checkpoint), "
                          f"got {checkpoint.keep_last}")


def _validate_dataset(config: TrainerConfig, where: str) -> None:
    """The kind and its keys; whether the files are there is the trainer's check (generate
    does not read data)."""
    dataset = config.dataset
    if dataset.kind not in DATASET_KINDS:
        raise RecipeError(f"{where}: dataset.kind: expected one of {', '.join(DATASET_KINDS)}, got {dataset.kind!r}")
    if dataset.kind != "synthetic" and not (dataset.path or "").strip():
        what = "a local file" if dataset.kind == "bytes" else f"a local {dataset.kind} file or a folder of them"
        raise RecipeError(f"{where}: dataset.path: required when dataset.kind is {dataset.kind!r} ({what}, "
                          f"relative to the recipe's folder)")
    if dataset.kind in ("jsonl", "parquet") and not dataset.text_column.strip():
        raise RecipeError(f"{where}: dataset.text_column: expected the name of the column holding each "
                          f"document's text, got an empty string")
    if dataset.sample_by not in TEXT_SAMPLE_BY:
        raise RecipeError(f"{where}: dataset.sample_by: expected one of {', '.join(TEXT_SAMPLE_BY)}, "
                          f"got {dataset.sample_by!r}")
    if isinstance(dataset.tokenize_workers, bool) or not isinstance(dataset.tokenize_workers, int) \
            or not 0 <= dataset.tokenize_workers <= MAX_TOKENIZE_WORKERS:
        raise RecipeError(f"{where}: dataset.tokenize_workers: expected an integer from 0 to {MAX_TOKENIZE_WORKERS} "
                          f"(0: one per core for large data, 1: tokenize in the preparing rank), got "
                          f"{dataset.tokenize_workers!r}")
    unused = [key for key, default in (("text_column", "text"), ("sample_by", "line"), ("shuffle", True),
                                       ("cache_dir", None), ("tokenize_workers", 0), ("streaming", False))
              if getattr(dataset, key) != default and not _dataset_reads(dataset.kind, key)]
    if unused:
        raise RecipeError(f"{where}: dataset.{unused[0]}: has no effect with dataset.kind {dataset.kind!r}; "
                          f"remove it (it applies to kind {', '.join(_KEY_KINDS[unused[0]])})")
    if dataset.streaming:
        _validate_streaming(config, where)


def _validate_streaming(config: TrainerConfig, where: str) -> None:
    """``dataset.streaming``: the rows come in order (shuffle defaults to false, true is
    refused), none can be held out, and no tokenizer processes run."""
    dataset, written = config.dataset, config._written_keys
    if "dataset.shuffle" not in written:
        dataset.shuffle = False  # the documented default under streaming
    fix = "set dataset.streaming: false (the token cache) or remove"
    if dataset.shuffle:
        raise RecipeError(f"{where}: dataset.shuffle: true cannot apply with dataset.streaming: true (a streamed "
                          f"dataset is read in order; a shuffled order needs every row at hand); fix: {fix} "
                          f"dataset.shuffle")
    if "dataset.tokenize_workers" in written:
        raise RecipeError(f"{where}: dataset.tokenize_workers: has no effect with dataset.streaming: true (each rank "
                          f"tokenizes the stream itself); fix: {fix} dataset.tokenize_workers")
    if config.training.eval is not None:
        raise RecipeError(f"{where}: training.eval: holds rows out of the dataset, which a streamed dataset does not "
                          f"have at hand; fix: {fix} training.eval")


MAX_TOKENIZE_WORKERS = 256  # processes on one node; more is a typo, not a machine

_KEY_KINDS = {"text_column": ("jsonl", "parquet"), "sample_by": ("text",), "shuffle": TOKENIZED_KINDS,
              "cache_dir": TOKENIZED_KINDS, "tokenize_workers": TOKENIZED_KINDS,
              "streaming": TOKENIZED_KINDS}


def _dataset_reads(kind: str, key: str) -> bool:
    """Whether a dataset of ``kind`` reads ``key``: a key that changes nothing is a mistake
    worth one line (``text_column`` under kind text reads no column)."""
    return kind in _KEY_KINDS[key]


def _build(cls: type, data: Any, where: str, key: str) -> Any:
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: {key or 'top level'}: expected a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    yaml_names = getattr(cls, "YAML_NAMES", {})  # field -> recipe key, where the key is no Python name
    fields = {yaml_names.get(f.name, f.name): f for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    unknown = sorted(k for k in data if k not in fields)
    if unknown:
        full = f"{key}.{unknown[0]}" if key else unknown[0]
        raise RecipeError(f"{where}: unknown key {full!r}; expected one of {', '.join(sorted(fields))}")
    values = {}
    for name, fld in fields.items():
        sub = f"{key}.{name}" if key else name
        if name in data:
            values[fld.name] = _convert(hints[fld.name], data[name], where, sub)
        elif fld.default is dataclasses.MISSING and fld.default_factory is dataclasses.MISSING:
            raise RecipeError(f"{where}: missing required key {sub!r}")
    return cls(**values)


def _convert(hint: Any, value: Any, where: str, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _convert(option, value, where, key)
            except RecipeError as exc:
                errors.append(exc)
        raise errors[0]
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where, key)
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{where}: {key}: expected a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(hint)
        return [_convert(item, v, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: {key}: expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if hint is Any:
        return value
    return _convert_scalar(hint, value, where, key)


def _convert_scalar(hint: type, value: Any, where: str, key: str) -> Any:
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise RecipeError(f"{where}: {key}: expected {hint.__name__}, got {type(value).__name__} {value!r}"
                          f"{_yaml_number_hint(hint, value)}")
    return value


def _yaml_number_hint(hint: type, value: Any) -> str:
    """YAML 1.1 reads ``1e-3`` and ``1.0e9`` (no dot, or no sign after the e) as text:
    say how to write the number so it reads as one."""
    if hint is not float or not isinstance(value, str) or not any(c.isdigit() for c in value):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    return f" (YAML reads {value} as text, not a number; write {yaml.safe_dump(number).splitlines()[0]})"


__all__ = ["RecipeError", "load_training_config", "validate_training_config", "PlanOverride"]
