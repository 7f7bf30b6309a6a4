"""``python -m torch.distributed.run --nproc_per_node=N -m hyper_parallel.trainer --config X.yaml``"""

import argparse
import sys

import torch.distributed as dist

from hyper_parallel.config import load_training_config
from hyper_parallel.trainer.base import BaseTrainer, write_metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyper_parallel.trainer",
                                     description="Train a recipe under torchrun (gloo on CPU).")
    parser.add_argument("--config", required=True, help="the training recipe (YAML)")
    parser.add_argument("--metrics", help="rank 0 writes per-step loss and tokens/s here (JSON)")
    args = parser.parse_args(argv)
    config = load_training_config(args.config)
    trainer = BaseTrainer(config)
    records = trainer.train()
    if args.metrics and trainer.rank == 0:
        write_metrics(records, args.metrics)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
