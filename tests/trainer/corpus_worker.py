"""torchrun worker: train a recipe with ``BaseTrainer`` as ``python -m hyper_parallel.trainer``
does, recording the ``input_ids`` every micro-batch of this rank fed the model, and the
per-step losses.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.trainer.corpus_worker --config R --out DIR

Writes ``DIR/rank<r>.json``: ``{"inputs": [micro-batch rows, ...], "losses": [...], "steps": [...]}``.
"""

import argparse
import json
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
    args = parser.parse_args()
    configure_console_logging(logger="hyper_parallel.trainer")
    trainer = BaseTrainer(load_training_config(args.config))
    inputs = []

    def record(_module, _args, kwargs):
        """The rows this rank trains on, as the model receives them."""
        inputs.append(kwargs["input_ids"].tolist())

    trainer.model.register_forward_pre_hook(record, with_kwargs=True)
    records = trainer.train()
    result = {"inputs": inputs, "losses": [r.loss for r in records], "steps": [r.step for r in records]}
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    leave_after_barrier(dist)


if __name__ == "__main__":
    main()
