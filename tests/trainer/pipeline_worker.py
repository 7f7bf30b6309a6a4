"""torchrun worker: a pipeline-parallel recipe trained for a few AdamW steps through the
trainer's own step (BaseTrainer: its model build, schedule, loss and optimizer), each
step's loss and this rank's stage's full gradients recorded before the update.

    python -m torch.distributed.run --nproc_per_node=N -m tests.trainer.pipeline_worker \
        --recipe R.yaml --steps 3 --out OUT_DIR

Writes ``OUT_DIR/rank<N>.pt``: {"stage": (index, start, end), "losses": [...],
"grads": [{name: tensor}, ...]} (each gradient whole: DTensor shards gathered).

``--cases FILE --out OUT`` trains every recipe of a ``{name: [flags...]}`` file in turn
in the same ranks (tests/batch_launch.py, tests/batch_worker.py), a new trainer per case
on the one process group; a case's flags are ``--recipe R --steps N --out DIR
--workspace W``: it writes ``DIR/rank<N>.pt`` as above, with ``$HYPER_PARALLEL_WORKSPACE``
set to ``W`` while its trainer is built (each recipe its own project and bundle).
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyper_parallel.config import load_training_config
from hyper_parallel.config.workspace import WORKSPACE_ENV
from hyper_parallel.distributed.pipeline import STAGE_ATTRIBUTE
from hyper_parallel.distributed.step_seed import seed_step
from hyper_parallel.trainer.base import BaseTrainer
from hyper_parallel.trainer.data import global_batch, micro_batches
from tests.batch_worker import run_cases
from tests.rank_exit import leave_after_barrier


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workspace", help="$HYPER_PARALLEL_WORKSPACE while the trainer is built")
    parser.add_argument("--cases", help="JSON file {name: [flags...]}: train these recipes in turn")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.cases is None:
        train(args)
    else:
        dist.init_process_group(backend="gloo")  # every case's trainer mesh reuses it (CPU)
        run_cases(args.cases, args.out, lambda flags: train(parse_args(flags)))
    leave_after_barrier(dist)


def train(args) -> dict:
    """One recipe trained ``args.steps`` steps; this rank's record saved under ``args.out``."""
    if args.workspace is not None:
        os.environ[WORKSPACE_ENV] = args.workspace
    config = load_training_config(args.recipe)
    trainer = BaseTrainer(config, resume=False)
    training = config.training
    dp_rank, dp_size = trainer._dp_coordinates()
    vocab = trainer.model.config.vocab_size
    record = {"stage": None, "losses": [], "grads": []}
    info = trainer.model.__dict__.get(STAGE_ATTRIBUTE)
    if info is not None:
        record["stage"] = (info.stages, info.layers)
    trainer.model.train()
    for step in range(args.steps):
        batch = global_batch(step, training, config.dataset, vocab)
        seed_step(step, training.seed)
        parts = list(micro_batches(batch, dp_rank, dp_size, training.micro_batch_size, config.where))
        loss = trainer.train_step.forward_backward(parts)  # this dp rank's mean, as the trainer has it
        if dp_size > 1:
            dist.all_reduce(loss, group=trainer.mesh_context.device_mesh.get_group("dp"))
            loss /= dp_size
        record["losses"].append(float(loss))
        record["grads"].append({name: whole(param.grad) for name, param in trainer.model.named_parameters()})
        trainer._optimizer_step(step + 1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    saved = Path(args.out) / f"rank{dist.get_rank()}.pt"
    torch.save(record, saved)
    return {"saved": str(saved)}


if __name__ == "__main__":
    main()
