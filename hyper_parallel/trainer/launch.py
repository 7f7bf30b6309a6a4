"""``python -m hyper_parallel.trainer launch --config X.yaml [--set KEY=VALUE ...]``: one command
that starts the recipe's ranks on this node.

The recipe already says how many processes a node runs and how many nodes there are
(``accelerator.nproc_per_node``, ``nnodes``); launch reads them, so nothing is typed twice.
Before any rank starts it checks what every rank would find alike (the recipe with its
``--set`` items, the weights ``model.init`` needs, the device, the data file, the
checkpoint folder) and refuses in one line (exit 2). Then it runs torchrun through its own
API (``torch.distributed.run``): ``--standalone`` on one node, a c10d rendezvous at
``--rdzv-endpoint`` with ``--node-rank`` on several. When a rank fails, the launch ends
with that rank's one error line (its exception, which the rank records in torchrun's error
file) or how it died, instead of the elastic agent's traceback; the rank's own output is
above it as it printed it.
"""

import argparse
import logging
import os
import sys

from hyper_parallel.config import RecipeError, load_training_config
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.trainer.cli_options import add_set_argument, set_arguments


def launch_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hyper_parallel.trainer launch",
        description="Start the recipe's ranks on this node with torchrun, the process count and nodes read from "
                    "the recipe; the recipe is checked first, and a failing rank's error is the last line.")
    parser.add_argument("--config", required=True, help="the training recipe (YAML)")
    add_set_argument(parser)
    parser.add_argument("--metrics", help="rank 0 streams one JSON line per step here")
    parser.add_argument("--no-resume", action="store_true", help="start from the model's weights, not a checkpoint")
    parser.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                        help="several nodes: the rendezvous every node's launch names alike (node 0's address)")
    parser.add_argument("--node-rank", type=int, default=int(os.environ.get("NODE_RANK", "0")),
                        help="several nodes: this node's index, 0 .. nnodes-1 (default $NODE_RANK or 0)")
    args = parser.parse_args(argv)
    try:
        config = load_training_config(args.config, args.set)
        _check_before_ranks(config, args)
    except HyperParallelError as exc:  # the project's refusals: recipe, weights, device, data, checkpoint folder
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _run_ranks(_torchrun_arguments(config, args))


def _check_before_ranks(config, args) -> None:
    """What every rank would refuse alike, refused once before any starts."""
    from hyper_parallel.models.hf.model_builder import weights_to_load
    from hyper_parallel.platform.device import resolve_run_device
    from hyper_parallel.trainer.checkpoint import checkpoint_root
    from hyper_parallel.trainer.data import bytes_dataset_file

    acc, training = config.accelerator, config.training
    weights_to_load(config)
    resolve_run_device(acc.device_type, where=str(config.where))
    if config.dataset.kind == "bytes":
        bytes_dataset_file(config.dataset, training.global_batch_size * training.seq_len, str(config.where))
    checkpoint_root(config, str(config.where))
    if acc.nnodes > 1 and not args.rdzv_endpoint:
        raise RecipeError(f"{config.where}: accelerator.nnodes is {acc.nnodes}: name the rendezvous with "
                          f"--rdzv-endpoint HOST:PORT (node 0's address, the same on every node) and this node's "
                          f"--node-rank")
    if not 0 <= args.node_rank < acc.nnodes:
        raise RecipeError(f"--node-rank: expected 0..{acc.nnodes - 1} (accelerator.nnodes of {config.where}), "
                          f"got {args.node_rank}")


def _torchrun_arguments(config, args) -> list[str]:
    acc = config.accelerator
    where = ["--standalone"] if acc.nnodes == 1 else [
        "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}", f"--node-rank={args.node_rank}"]
    rank_arguments = ["--config", args.config, *set_arguments(args.set),
                      *(["--metrics", args.metrics] if args.metrics else []), *(["--no-resume"] if args.no_resume else [])]
    return [f"--nproc-per-node={acc.nproc_per_node}", f"--nnodes={acc.nnodes}", *where,
            "--module", "hyper_parallel.trainer", *rank_arguments]


def _run_ranks(arguments: list[str]) -> int:
    """torchrun's own entry (``torch.distributed.run.run``) on ``arguments``; a failure
    reported as the first failed rank's one line."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    for name in ("torch.distributed", "torch.distributed.run", "torch.distributed.elastic"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # the agent's own lines and traceback
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, set here so it says nothing of it
    try:
        run(get_args_parser().parse_args(arguments))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        how = (f"died of signal {failure.signal_name()}" if failure.exitcode < 0
               else f"exited with code {failure.exitcode}")
        message = failure.message if isinstance(failure.message, str) else str(failure.message)
        silent = failure.exitcode < 0 or message.startswith("To enable traceback")  # no error file: nothing said
        said = "" if silent else f": {message.strip().splitlines()[-1]}"
        print(f"error: rank {rank} {how}{said}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0
