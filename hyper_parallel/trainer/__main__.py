"""``python -m torch.distributed.run --nproc_per_node=N -m hyper_parallel.trainer --config X.yaml``"""

import argparse
import os
import sys
from datetime import timedelta

from hyper_parallel.config import RecipeError, load_training_config
from hyper_parallel.console_log import configure_console_logging
from hyper_parallel.distributed.rank_exit import exit_rank
from hyper_parallel.trainer.cli_options import add_set_argument

# torch and the trainer are imported after the arguments are read: `--help` and a usage
# error answer at once, without torch's seconds of import.


EPILOG = """\
example:
  python -m hyper_parallel.trainer launch --config recipes/tiny_cpu/qwen3_moe_tiny.yaml --set training.steps=3
  (the same as: python -m torch.distributed.run --standalone --nproc_per_node=2 -m hyper_parallel.trainer \\
      --config recipes/tiny_cpu/qwen3_moe_tiny.yaml --set training.steps=3)

The recipe's accelerator section sets the parallel sizes (their product is the number
of processes to launch), modeling_backend / codegen pick the model (hf, custom, or the
generated bundle, which rank 0 generates or reuses before training), and its training
section sets steps, global_batch_size, micro_batch_size, seq_len, seed, log_every,
activation_checkpointing, compile and max_grad_norm; optimizer sets AdamW's lr, betas
and weight_decay; dataset is synthetic tokens (kind: synthetic), local documents tokenized
with the model folder's tokenizer and packed into seq_len with EOS between documents
(kind: text | jsonl | parquet, path, text_column, sample_by, shuffle; needs pip install
-e ".[data]"), or a file's bytes as token ids (kind: bytes, path).
Rank 0 prints one line per log_every steps: loss, gradient norm, lr, tokens/s, MFU (with
training.metrics.peak_flops_per_s), peak memory, ETA. training.mixed_precision (default:
float32 master weights, compute in model.torch_dtype, float32 reduction; none: all in
model.torch_dtype). training.lr_schedule: {warmup_steps, decay: constant|linear|cosine,
min_lr_ratio}; training.eval: {every_steps, batches} records eval_loss on held-out data.

training.checkpoint: {dir, every_steps, keep_last, async, resume} saves step_<N>/
folders under dir (relative to the recipe's folder); a restarted run resumes from the
newest complete one unless --no-resume (or resume: false) says otherwise.

export: python -m hyper_parallel.trainer export --checkpoint DIR/step_N --out HF_DIR
writes the checkpoint as an HF model folder (alone, or under torchrun: each rank its share).

--metrics PATH streams one JSON line per finished step (loss, grad_norm, lr, tokens_per_s,
mfu, peak_memory_bytes per rank, eta_s, eval_loss); training.metrics: {tensorboard_dir,
peak_flops_per_s} adds TensorBoard scalars and MFU.
plot: python -m hyper_parallel.trainer plot METRICS --out loss.png draws loss and tokens/s.
accelerator.device_type (cpu | cuda | npu) is the run's device: every tensor of a step lives
there, and a recipe whose device this machine lacks is refused (exit 2) unless
HYPER_PARALLEL_DEVICE_FALLBACK=cpu asks for the CPU on purpose.
dry-run: python -m hyper_parallel.trainer dry-run --config X.yaml --rank R|all [--steps N] runs rank R
of the recipe's world alone on this machine (torch's fake process group: real plan, FSDP2,
pipeline stage and optimizer, collectives skipped) and reports its peak memory and step time.
prepare-data: python -m hyper_parallel.trainer prepare-data --config X.yaml tokenizes and packs the
recipe's dataset into the token cache ahead of a run (training then reads no text).
"""


def prepare_data_main(argv: list[str]) -> int:
    """``prepare-data``: the recipe's dataset tokenized and packed into the token cache
    (trainer/token_cache.py) by one process, so that training starts from the cache."""
    import time

    from hyper_parallel.config.schema import TOKENIZED_KINDS
    from hyper_parallel.models.hf.model_builder import recipe_model_dir
    from hyper_parallel.trainer.corpus import prepare_corpus
    from hyper_parallel.trainer.data import DataError

    parser = argparse.ArgumentParser(prog="python -m hyper_parallel.trainer prepare-data",
                                     description="Tokenize and pack a recipe's dataset into the token cache "
                                                 "(dataset.cache_dir, default generated/tokens) ahead of training.")
    parser.add_argument("--config", required=True, help="the training recipe (YAML)")
    args = parser.parse_args(argv)
    configure_console_logging(logger="hyper_parallel.trainer")  # the progress lines
    try:
        config = load_training_config(args.config)
        if config.dataset.kind not in TOKENIZED_KINDS:
            raise RecipeError(f"{config.where}: dataset.kind: {config.dataset.kind!r} is not tokenized (nothing to "
                              f"prepare); prepare-data reads kinds {', '.join(TOKENIZED_KINDS)}")
        if config.dataset.streaming:
            raise RecipeError(f"{config.where}: dataset.streaming: true reads and tokenizes the files during "
                              f"training, with no token cache (nothing to prepare); fix: set dataset.streaming: "
                              f"false to prepare the cache")
        started = time.perf_counter()
        corpus = prepare_corpus(config.dataset, config.training, recipe_model_dir(config), config.where)
    except (RecipeError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{corpus.cache}: {corpus.num_rows:,} sequences of {config.training.seq_len} tokens from "
          f"{corpus.documents:,} documents ({time.perf_counter() - started:.1f}s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:  # python -m hyper_parallel.trainer export --checkpoint DIR --out HF_DIR
        from hyper_parallel.trainer.export import export_main

        return export_main(argv[1:])
    if argv[:1] == ["plot"]:  # python -m hyper_parallel.trainer plot METRICS --out loss.png
        from hyper_parallel.trainer.plot import plot_main

        return plot_main(argv[1:])
    if argv[:1] == ["prepare-data"]:  # python -m hyper_parallel.trainer prepare-data --config X.yaml
        return prepare_data_main(argv[1:])
    if argv[:1] == ["launch"]:  # python -m hyper_parallel.trainer launch --config X.yaml [--set K=V]
        from hyper_parallel.trainer.launch import launch_main

        return launch_main(argv[1:])
    if argv[:1] == ["dry-run"]:  # python -m hyper_parallel.trainer dry-run --config X.yaml --rank R
        from hyper_parallel.trainer.dry_run import dry_run_main

        return dry_run_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m hyper_parallel.trainer", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="python -m hyper_parallel.trainer launch --config X.yaml [--set KEY=VALUE ...]   (starts the ranks)\n"
              "       python -m hyper_parallel.trainer --config X.yaml [--set KEY=VALUE ...]   (one rank, under torchrun)\n"
              "       python -m hyper_parallel.trainer {export,plot,prepare-data,dry-run} ... (each has its --help)",
        description="Train a recipe under torchrun (gloo on CPU, nccl/hccl on accelerators).",
        epilog=EPILOG)
    parser.add_argument("--config", required=True, help="the training recipe (YAML)")
    parser.add_argument("--metrics", help="rank 0 streams one JSON line per step here as it ends (loss, grad_norm, "
                                          "lr, tokens_per_s, mfu, peak_memory_bytes per rank, eta_s, eval_loss); "
                                          "a resumed run keeps the lines up to its checkpoint's step")
    parser.add_argument("--no-resume", action="store_true",
                        help="start from the model's weights even when training.checkpoint.dir holds a checkpoint")
    add_set_argument(parser)
    args = parser.parse_args(argv)
    import torch.distributed as dist

    from hyper_parallel.models.hf.model_builder import ModelBuildError, weights_to_load
    from hyper_parallel.platform.device import DeviceUnavailableError, resolve_run_device
    from hyper_parallel.runtime.assembly import AssemblyError
    from hyper_parallel.trainer.base import BaseTrainer
    from hyper_parallel.trainer.checkpoint import CheckpointError, checkpoint_root
    from hyper_parallel.trainer.data import DataError, bytes_dataset_file

    try:
        config = load_training_config(args.config, args.set)
        weights_to_load(config)  # model.init: pretrained needs weights; said before any rank starts
        resolve_run_device(config.accelerator.device_type, where=str(config.where))  # absent: refused, not CPU
    except (RecipeError, ModelBuildError, DeviceUnavailableError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        world = config.accelerator.nproc_per_node
        print(f"error: {args.config}: the trainer runs under torchrun (this recipe needs {world} process(es) "
              f"per node); run: python -m torch.distributed.run --nproc_per_node={world} "
              f"-m hyper_parallel.trainer --config {args.config}", file=sys.stderr)
        return 2
    try:
        if config.dataset.kind == "bytes":
            bytes_dataset_file(config.dataset, config.training.global_batch_size * config.training.seq_len,
                              config._yaml_path or args.config)
        checkpoint_root(config, config._yaml_path or args.config)
    except (DataError, CheckpointError) as exc:
        return _refuse(exc)
    # The step lines; the codegen progress under it stays quiet (its warnings still show).
    configure_console_logging(logger="hyper_parallel.trainer")
    try:
        # Data read and tokenized, a checkpoint checked before it is loaded: every rank finds
        # the same problem (the same files, the same global shapes), none waits for another.
        trainer = BaseTrainer(config, resume=not args.no_resume, metrics_path=args.metrics)
        trainer.train()
    # Found alike by every rank from the recipe and its files (a bundle folder that cannot be
    # one, a model that cannot be built): one line, not a traceback per rank.
    except (DataError, CheckpointError, RecipeError, ModelBuildError, AssemblyError, DeviceUnavailableError) as exc:
        return _refuse(exc)
    dist.barrier()  # nobody leaves while a peer may still be receiving from it
    dist.destroy_process_group()
    return 0


def _refuse(exc: Exception) -> int:
    """A bad dataset or checkpoint, found alike by every rank: rank 0 says it in one line,
    every rank leaves with 2 (no traceback, nothing written)."""
    if os.environ.get("RANK") == "0":  # one line, not one per rank
        print(f"error: {exc}", file=sys.stderr, flush=True)
    _leave_together()
    return 2


def _leave_together(timeout_s: float = 60.0) -> None:
    """Once the process group exists, the ranks that refused meet before leaving: the
    first rank to exit makes torchrun end the others, and rank 0 must have said why first.
    Bounded (gloo's monitored barrier); a rank that did not refuse, or a backend without
    it, is not waited for."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
    except RuntimeError:
        pass


def _entry() -> int:
    """``main``; under torchrun an exception is also recorded in the rank's error file, so a
    launch names it in one line (``trainer launch``)."""
    if "TORCHELASTIC_ERROR_FILE" in os.environ:
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(main)()
    return main()


if __name__ == "__main__":
    exit_rank(_entry())  # without the interpreter's teardown (see rank_exit)
