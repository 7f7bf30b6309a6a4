"""torchrun worker: train a recipe with ``BaseTrainer`` as ``python -m hyper_parallel.trainer``
does, recording the ``input_ids`` every micro-batch of this rank fed the model, and the
per-step losses.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.trainer.corpus_worker --config R --out DIR

Writes ``DIR/rank<r>.json``: ``{"inputs": [micro-batch rows, ...], "losses": [...], "steps": [...]}``.

``--resume-copy FOLDER --drop PATH --resume-out DIR2 --marker LINE`` then, in the same
ranks (one launch instead of two), copies the recipe's folder to FOLDER once every rank
is done, deletes FOLDER/PATH (a newer checkpoint), prints LINE (rank 0) and trains
FOLDER's recipe the same way with a new trainer, which resumes from the newest checkpoint
left: its results go to ``DIR2``.
"""

import argparse
import json
import shutil
from pathlib import Path

import torch.distributed as dist

from hyper_parallel.config import load_training_config
from hyper_parallel.console_log import configure_console_logging
from hyper_parallel.trainer.base import BaseTrainer
from tests.rank_exit import leave_after_barrier


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume-copy", help="then resume a copy of the recipe's folder made here")
    parser.add_argument("--drop", help="the path under --resume-copy to delete first (a newer checkpoint)")
    parser.add_argument("--resume-out", help="the resumed run's results")
    parser.add_argument("--marker", default="", help="the line rank 0 prints between the two runs")
    args = parser.parse_args()
    configure_console_logging(logger="hyper_parallel.trainer")
    train_recording(args.config, args.out)
    if args.resume_copy:
        recipe = Path(args.config)
        dist.barrier()  # every rank's checkpoint files written
        if dist.get_rank() == 0:
            shutil.copytree(recipe.parent, args.resume_copy)
            shutil.rmtree(Path(args.resume_copy, args.drop))
            print(args.marker, flush=True)
        dist.barrier()
        Path(args.resume_out).mkdir(exist_ok=True)
        train_recording(Path(args.resume_copy, recipe.name), args.resume_out)
    leave_after_barrier(dist)


def train_recording(config, out) -> None:
    """A new trainer for ``config`` trains it; this rank's inputs, losses and steps go to ``out``."""
    trainer = BaseTrainer(load_training_config(config))
    inputs = []

    def record(_module, _args, kwargs):
        """The rows this rank trains on, as the model receives them."""
        inputs.append(kwargs["input_ids"].tolist())

    trainer.model.register_forward_pre_hook(record, with_kwargs=True)
    records = trainer.train()
    result = {"inputs": inputs, "losses": [r.loss for r in records], "steps": [r.step for r in records]}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
