"""torchrun worker: several trainings of the same world size, one after another in the
same ranks (one launch instead of one per training), each as ``python -m
hyper_parallel.trainer --config RECIPE --metrics METRICS`` trains: a new ``BaseTrainer``
on the recipe, rank 0 writing the per-step metrics.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.trainer.train_chain_worker --chain CHAIN.json

CHAIN.json is a list of runs ``{"name", "recipe", "text", "metrics", "copies"}`` (and
optionally ``"dtypes"``: a file where rank 0 writes the dtypes its trained parameters and
AdamW state are held in), in order. Before a run, once every rank is done with the one before, rank 0 copies each
``[source, destination]`` folder of ``copies`` (a checkpoint the run resumes) and writes
``text`` to ``recipe`` (runs of the generated bundle share the recipe's own file), and
prints the line ``CHAIN_MARKER + name``, so a test can tell each run's output apart.
A run that raises ends every rank (exit code 1): the runs after it do not start.
"""

import argparse
import json
import shutil
from pathlib import Path

import torch.distributed as dist

from hyper_parallel.config import load_training_config
from hyper_parallel.console_log import configure_console_logging
from hyper_parallel.trainer.base import BaseTrainer
from hyper_parallel.trainer.metrics import write_metrics
from tests.rank_exit import leave_after_barrier

CHAIN_MARKER = "train_chain_worker: run "  # tests/trainer/test_checkpoint_reshard.py splits the output by it


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chain", required=True)
    args = parser.parse_args()
    configure_console_logging(logger="hyper_parallel.trainer")
    dist.init_process_group(backend="gloo")  # the trainers' meshes reuse it (CPU)
    for run in json.loads(Path(args.chain).read_text()):
        dist.barrier()  # the run before: every rank's checkpoint and metrics written
        if dist.get_rank() == 0:
            for source, destination in run["copies"]:
                shutil.copytree(source, destination)
            Path(run["recipe"]).write_text(run["text"])
            print(CHAIN_MARKER + run["name"], flush=True)
        dist.barrier()
        trainer = BaseTrainer(load_training_config(run["recipe"]))
        records = trainer.train()
        if trainer.rank == 0:
            write_metrics(records, run["metrics"])
            if run.get("dtypes"):
                Path(run["dtypes"]).write_text(json.dumps(_dtypes(trainer)))
    leave_after_barrier(dist)


def _dtypes(trainer: BaseTrainer) -> dict[str, list[str]]:
    """The dtypes of the trained model's parameters and of AdamW's tensors, as sets."""
    state = [value for per_param in trainer.optimizer.state.values() for key, value in per_param.items()
             if key != "step" and hasattr(value, "dtype")]
    return {"parameters": sorted({str(p.dtype) for p in trainer.model.parameters()}),
            "optimizer_state": sorted({str(v.dtype) for v in state})}


if __name__ == "__main__":
    main()
