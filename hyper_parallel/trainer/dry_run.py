"""``python -m hyper_parallel.trainer dry-run --config X.yaml --rank R [--steps N]``: one rank of
the recipe's world, alone on this machine's device, on torch's fake process group.

What torchtitan's ``comm.mode=fake_backend`` does, for our trainer: rank ``R`` of a world of
``W`` builds the real mesh, the bundle's plan, FSDP2, its pipeline stage and its optimizer,
with the shapes that rank has in the real run, and trains ``N`` steps whose collectives
hand back what they were given (``torch.testing._internal.distributed.fake_pg``). The
losses mean nothing; the rank's peak memory (the accelerator allocator's peak, or the
process's resident peak on the CPU) and step times are what it reports. So a CPU runs
every rank of a small layout, and one GPU runs any rank of a 64-rank layout with its
real kernels.

The run is the recipe's, except what only a real world has: the model starts from a
random initialization (no checkpoint is read), the data is synthetic tokens of the
recipe's shapes, nothing is saved (no checkpoint, metrics or TensorBoard), and the run
device is this machine's (the recipe's accelerator where present, else the CPU, as
``platform.device.FALLBACK_ENV`` asks). ``--rank all`` runs each rank in a process of its
own, one after another, and prints a line per rank. Not yet: pipeline layouts (pp > 1),
whose stages learn their input shapes from their neighbours.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from hyper_parallel.config import RecipeError, load_training_config
from hyper_parallel.console_log import configure_console_logging
from hyper_parallel.platform.device import FALLBACK_ENV
from hyper_parallel.trainer.cli_options import add_set_argument, set_arguments

REPORT_PREFIX = "dry-run report: "  # the JSON line each rank's process prints for --rank all


def dry_run_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hyper_parallel.trainer dry-run",
        description="Run one rank of a recipe's world alone on this machine (torch's fake process group): the real "
                    "mesh, plan, FSDP2, pipeline stage and optimizer of that rank, collectives skipped; reports its "
                    "peak memory and step time.")
    parser.add_argument("--config", required=True, help="the training recipe (YAML)")
    parser.add_argument("--rank", default="0", help="the rank to run (0 .. world-1), or 'all' for each in turn")
    parser.add_argument("--steps", type=int, default=2, help="training steps to run (default 2)")
    parser.add_argument("--json", metavar="PATH", help="also write the reports here (a JSON list)")
    add_set_argument(parser)
    args = parser.parse_args(argv)
    try:
        config = load_training_config(args.config, args.set)
        world = config.accelerator.parallel_dims.world_size
        ranks = range(world) if args.rank == "all" else [_rank(args.rank, world, args.config)]
        if args.steps < 1:
            raise RecipeError(f"--steps: expected at least 1, got {args.steps}")
        if config.accelerator.parallel_dims.pp > 1:  # PipelineStage infers its shapes from its neighbours
            raise RecipeError(f"{config.where}: accelerator.pp_size is {config.accelerator.parallel_dims.pp}: a dry "
                              "run of a pipeline stage is not supported yet (torch's PipelineStage learns its input "
                              "shapes from the previous stage, which a rank alone does not have)")
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.rank != "all":
        report = run_rank(config, ranks[0], args.steps)
        print(_line(report))
        print(REPORT_PREFIX + json.dumps(report), flush=True)
        reports = [report]
    else:
        reports = []
        for rank in ranks:
            report = _rank_in_own_process(args.config, rank, args.steps, args.set)
            if report is None:
                return 1
            print(_line(report), flush=True)
            reports.append(report)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(reports, out, indent=1)
    return 0


def _rank(text: str, world: int, where: str) -> int:
    """``--rank`` as a rank of the recipe's world, or a refusal naming both."""
    if not text.isdigit() or int(text) >= world:
        raise RecipeError(f"--rank: expected 0..{world - 1} (the world of {where}) or 'all', got {text!r}")
    return int(text)


def run_rank(config, rank: int, steps: int) -> dict:
    """Rank ``rank`` of ``config``'s world for ``steps`` steps in this process; its report."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hyper_parallel.trainer.base import BaseTrainer

    acc = config.accelerator
    world = acc.parallel_dims.world_size
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      GROUP_RANK=str(rank // acc.nproc_per_node))
    os.environ.setdefault(FALLBACK_ENV, "cpu")  # this machine's device: the recipe's where present
    _alone(config, steps)
    configure_console_logging(logger="hyper_parallel.trainer")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        started = time.perf_counter()
        trainer = BaseTrainer(config, resume=False)
        built = time.perf_counter() - started
        records = trainer.train()
        peak = trainer.device.peak_memory_bytes()
        device = str(trainer.device.device)
    finally:
        dist.destroy_process_group()
    seconds = [record.seconds for record in records]
    return {"rank": rank, "world": world, "device": device, "steps": len(records), "build_s": round(built, 3),
            "step_s": [round(s, 4) for s in seconds], "steady_step_s": round(min(seconds[1:] or seconds), 4),
            "peak_memory_bytes": peak}


def _alone(config, steps: int) -> None:
    """What only a real world has, taken out (the module docstring says why)."""
    training = config.training
    training.steps = steps
    training.checkpoint.dir = None
    training.eval = None
    training.metrics.tensorboard_dir = None
    config.model.init = "random"
    if config.dataset.kind != "synthetic":
        config.dataset.kind, config.dataset.path, config.dataset.streaming = "synthetic", None, False


def _rank_in_own_process(config_path: str, rank: int, steps: int, overrides: list[str]) -> dict | None:
    """One rank's dry run in a fresh process (its memory peak is its own); None, with the
    process's output shown, when it failed."""
    command = [sys.executable, "-m", "hyper_parallel.trainer", "dry-run", "--config", config_path,
               "--rank", str(rank), "--steps", str(steps), *set_arguments(overrides)]
    proc = subprocess.run(command, capture_output=True, text=True)
    reports = [line[len(REPORT_PREFIX):] for line in proc.stdout.splitlines() if line.startswith(REPORT_PREFIX)]
    if proc.returncode != 0 or not reports:
        print(f"error: the dry run of rank {rank} failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}",
              file=sys.stderr)
        return None
    return json.loads(reports[-1])


def _line(report: dict) -> str:
    return (f"rank {report['rank']}/{report['world']} on {report['device']}: {report['steps']} steps, "
            f"steady step {report['steady_step_s']:.3f}s (built in {report['build_s']:.1f}s), "
            f"peak memory {report['peak_memory_bytes'] / 2**30:.2f} GiB")
