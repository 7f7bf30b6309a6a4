"""What a run says before its first step and after its last (rank 0, a few lines each):
what it trains, on what, in which precision, from which data, and where its outputs go;
then how far it got and where to find the results."""

import math
import sys
import time

import torch
from torch.distributed.tensor import DTensor

from hyper_parallel.config.precision import precision_policy
from hyper_parallel.config.schema import TrainerConfig
from hyper_parallel.protocols.axes import EP, MESH_AXES


def startup_lines(config: TrainerConfig, model: torch.nn.Module, device, corpus, metrics_path: str | None,
                  first_step: int) -> list[str]:
    """The run in five lines: model and backend, layout and device, precision and
    optimizer, data, outputs."""
    acc, training = config.accelerator, config.training
    total = sum(p.numel() for p in model.parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    dims = acc.parallel_dims
    layout = " ".join(f"{axis} {getattr(dims, axis)}" for axis in (*MESH_AXES, EP)
                      if getattr(dims, axis) > 1) or "one rank"
    policy = precision_policy(config)
    steps = training.steps - first_step
    tokens = training.global_batch_size * training.seq_len
    rows = getattr(corpus, "num_rows", None)  # None: streamed (no token cache, no length known ahead)
    data = (f"{config.dataset.kind} tokens" if corpus is None else
            f"{config.dataset.path}, streamed" if rows is None else
            f"{rows:,} packed rows of {config.dataset.path} "
            f"({training.steps * training.global_batch_size / max(rows, 1):.2f} epochs)")
    outputs = [f"checkpoints {_checkpoints(config)}" if training.checkpoint.dir else "no checkpoints"]
    if metrics_path:
        outputs.append(f"metrics {metrics_path}")
    if training.metrics.tensorboard_dir:
        outputs.append(f"TensorBoard {config.folder / training.metrics.tensorboard_dir}")
    return [
        f"model: {_model_class(model).__name__} from {_backend(model)}, {_count(total)} parameters, "
        f"{_count(local)} on this rank",
        f"layout: {layout} over {dims.world_size} rank(s) on {device}",
        f"precision: {policy.master} master weights, {policy.compute} compute, {policy.reduce} reduction; "
        f"{config.optimizer.name} lr {config.optimizer.lr:g}",
        f"data: {data}; {steps} step(s) of {training.global_batch_size} x {training.seq_len} = {tokens:,} tokens"
        + (f", from step {first_step}" if first_step else ""),
        f"outputs: {', '.join(outputs)}",
    ]


def closing_lines(records: list, config: TrainerConfig, started: float, metrics_path: str | None) -> list[str]:
    """Steps, tokens and time of this run, the best eval loss, and where the results are."""
    if not records:
        return ["trained no step"]
    training = config.training
    seconds = time.perf_counter() - started
    tokens = len(records) * training.global_batch_size * training.seq_len
    evals = [r.eval_loss for r in records if r.eval_loss is not None and math.isfinite(r.eval_loss)]
    lines = [f"done: {len(records)} step(s), {tokens:,} tokens in {seconds:.1f}s; loss {records[0].loss:.4f} -> "
             f"{records[-1].loss:.4f}" + (f"; best eval loss {min(evals):.4f}" if evals else "")]
    where = []
    if training.checkpoint.dir:
        where.append(f"checkpoint {_checkpoints(config) / f'step_{records[-1].step}'}")
    if metrics_path:
        where.append(f"metrics {metrics_path} (plot: python -m hyper_parallel.trainer plot {metrics_path} "
                     f"--out loss.png)")
    if where:
        lines.append("results: " + "; ".join(where))
    return lines


def _backend(model: torch.nn.Module) -> str:
    """Which modeling code the run trains: the generated bundle's file, transformers' or the
    custom one (models/common)."""
    module = _model_class(model).__module__
    if module.startswith("transformers."):
        return f"transformers ({module})"
    source = getattr(sys.modules.get(module), "__file__", None)
    if module.startswith("hyper_parallel.models"):
        return f"the custom backend ({module})"
    return f"the generated bundle {source}" if source else module


def _model_class(model: torch.nn.Module) -> type:
    """The model's own class: FSDP2 (dp > 1) swaps in a subclass of its own making
    (``FSDP<Name>``, defined in torch), whose name and module say nothing of the model."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(model)
    return next(base for base in cls.__mro__ if not issubclass(base, FSDPModule)) if issubclass(cls, FSDPModule) \
        else cls


def _checkpoints(config: TrainerConfig):
    """``training.checkpoint.dir`` as the trainer resolves it (against the recipe's folder)."""
    from hyper_parallel.trainer.checkpoint import checkpoint_root

    return checkpoint_root(config, str(config.where)).resolve()


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
