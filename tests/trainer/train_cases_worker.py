"""torchrun worker: several recipes of one world size trained in turn in the same ranks,
each as ``python -m hyper_parallel.trainer --config RECIPE --metrics METRICS`` trains it (a
new ``BaseTrainer`` on the one process group), for ``tests/batch_launch.py``.

    python -m torch.distributed.run --nproc_per_node=N -m tests.trainer.train_cases_worker \
        --cases CASES.json --out OUT

A case's flags: ``--recipe R --metrics M --log L [--workspace W] [--no-resume]``. Rank 0
streams the per-step metrics to ``M``; every rank writes what the trainer logs (the step
lines, the compile, pipeline and checkpoint lines: the trainer CLI's stdout) to
``L.rank<N>``; ``$HYPER_PARALLEL_WORKSPACE`` is ``W`` while the case runs (each recipe its
own project and bundle). A case that raises is named by ``tests/batch_worker.run_cases``.

What a test did between two launches, rank 0 does before the case, once every rank is
done with the case before: ``--text FILE`` writes FILE's content to the recipe; ``--list
DIR`` records DIR's entries as the case found them (each folder's ``COMPLETE.json``, or
None), returned as ``{"before": {name: marker}}``; ``--unlink PATH`` removes a file and
``--plant PATH`` writes ``b"partial"`` to one (its folders made), as a killed run leaves them.
"""

import argparse
import json
import logging
import os
from pathlib import Path

import torch.distributed as dist

from hyper_parallel.config import load_training_config
from hyper_parallel.config.workspace import WORKSPACE_ENV
from hyper_parallel.console_log import configure_console_logging
from hyper_parallel.trainer.base import BaseTrainer
from tests.batch_worker import run_cases
from tests.rank_exit import leave_after_barrier

TRAINER_LOGGER = "hyper_parallel.trainer"  # what the trainer CLI shows on stdout


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases")
    parser.add_argument("--out")
    parser.add_argument("--recipe")
    parser.add_argument("--metrics")
    parser.add_argument("--log")
    parser.add_argument("--workspace")
    parser.add_argument("--no-resume", action="store_true")
    parser.add_argument("--text")
    parser.add_argument("--list")
    parser.add_argument("--unlink", action="append", default=[])
    parser.add_argument("--plant", action="append", default=[])
    return parser.parse_args(argv)


def _before(args) -> dict:
    """Rank 0's changes to the files before the case (see the module docstring)."""
    result = {}
    if dist.get_rank() == 0:
        if args.list is not None:
            result["before"] = {p.name: json.loads((p / "COMPLETE.json").read_text())
                                if (p / "COMPLETE.json").is_file() else None for p in sorted(Path(args.list).iterdir())}
        if args.text is not None:
            Path(args.recipe).write_text(Path(args.text).read_text())
        for path in args.unlink:
            Path(path).unlink()
        for path in args.plant:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_bytes(b"partial")
    dist.barrier()
    return result


def train(args) -> dict:
    result = _before(args)
    if args.workspace is not None:
        os.environ[WORKSPACE_ENV] = args.workspace
    handler = logging.FileHandler(f"{args.log}.rank{dist.get_rank()}", mode="w")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger(TRAINER_LOGGER).addHandler(handler)
    try:
        BaseTrainer(load_training_config(args.recipe), resume=not args.no_resume, metrics_path=args.metrics).train()
    finally:
        logging.getLogger(TRAINER_LOGGER).removeHandler(handler)
        handler.close()
    dist.barrier()  # every rank done with this case (its metrics written) before the next one
    return result


def main() -> None:
    args = parse_args()
    configure_console_logging(logger=TRAINER_LOGGER)  # as the trainer CLI does
    dist.init_process_group(backend="gloo")  # every case's trainer mesh reuses it (CPU)
    run_cases(args.cases, args.out, lambda flags: train(parse_args(flags)))
    leave_after_barrier(dist)


if __name__ == "__main__":
    main()
