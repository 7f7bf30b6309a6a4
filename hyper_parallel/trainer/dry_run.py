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

``--fake-tensors``: the rank's tensors are torch's fake tensors (``FakeTensorMode``: shapes,
dtypes and devices, no storage, no arithmetic), so a rank of a 235B layout runs on a laptop.
The model is planned on the meta device and given fake shards (no weights read); the
memory comes from torch's tracker over the steps (``torch.distributed._tools.MemTracker``:
every tensor's storage counted while it lives, by kind: parameters, gradients, optimizer
states, activations, temporaries), so the peak is what the rank's tensors need, before the
allocator's own overhead. The router's choices have no values there: the routed rows are
spread evenly over the experts and ranks (``platform/host_values.py``), the load a balanced
router gives. A step runs at most ``FAKE_MICRO_BATCHES`` of its micro-batches: the peak of
a step is reached by its second (the first one's gradients held while the second's
activations live) and repeats after it; the second step's includes the optimizer states.
"""

import argparse
import contextlib
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
FAKE_MICRO_BATCHES = 2  # a fake step's micro-batches (module docstring: the peak repeats after the second)


def dry_run_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hyper_parallel.trainer dry-run",
        description="Run one rank of a recipe's world alone on this machine (torch's fake process group): the real "
                    "mesh, plan, FSDP2, pipeline stage and optimizer of that rank, collectives skipped; reports its "
                    "peak memory and step time.")
    parser.add_argument("--config", required=True, help="the training recipe (YAML)")
    parser.add_argument("--rank", default="0", help="the rank to run (0 .. world-1), or 'all' for each in turn")
    parser.add_argument("--steps", type=int, default=2, help="training steps to run (default 2)")
    parser.add_argument("--fake-tensors", action="store_true",
                        help="fake tensors (shapes without storage): any rank of any size on this machine; the peak "
                             "memory from torch's memory tracker, by kind")
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
        report = run_rank(config, ranks[0], args.steps, fake_tensors=args.fake_tensors)
        print(_line(report))
        print(REPORT_PREFIX + json.dumps(report), flush=True)
        reports = [report]
    else:
        reports = []
        for rank in ranks:
            report = _rank_in_own_process(args.config, rank, args.steps, args.set, args.fake_tensors)
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


def run_rank(config, rank: int, steps: int, *, fake_tensors: bool = False) -> dict:
    """Rank ``rank`` of ``config``'s world for ``steps`` steps in this process; its report."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    acc = config.accelerator
    world = acc.parallel_dims.world_size
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      GROUP_RANK=str(rank // acc.nproc_per_node))
    os.environ.setdefault(FALLBACK_ENV, "cpu")  # this machine's device: the recipe's where present
    _alone(config, steps)
    report = {"rank": rank, "world": world}
    if fake_tensors:
        report.update(_fake_micro_batches(config))
    configure_console_logging(logger="hyper_parallel.trainer")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        report.update(_run_fake(config) if fake_tensors else _run_real(config))
    finally:
        dist.destroy_process_group()
    seconds = report.pop("seconds")
    report.update(steps=len(seconds), step_s=[round(s, 4) for s in seconds],
                  steady_step_s=round(min(seconds[1:] or seconds), 4))
    return report


def _run_real(config) -> dict:
    """The rank's steps on real tensors: the device's own peak."""
    from hyper_parallel.trainer.base import BaseTrainer

    started = time.perf_counter()
    trainer = BaseTrainer(config, resume=False)
    built = time.perf_counter() - started
    records = trainer.train()
    return {"device": str(trainer.device.device), "build_s": round(built, 3),
            "seconds": [record.seconds for record in records], "peak_memory_bytes": trainer.device.peak_memory_bytes()}


def _run_fake(config) -> dict:
    """The rank's steps on fake tensors, under torch's memory tracker: the peak its tensors
    need, by kind (the module docstring says what is counted)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hyper_parallel.trainer.base import BaseTrainer

    mode = FakeTensorMode(allow_non_fake_inputs=True)  # real host-side tensors (a mesh's ranks) mix in
    started = time.perf_counter()
    with _grouped_mm_of_any_float(), mode:
        trainer = BaseTrainer(config, resume=False)
    built = time.perf_counter() - started
    tracker = _step_peak_tracker()
    tracker.track_external(trainer.model, trainer.optimizer)
    with _each_forward_anew(tracker, trainer.model), _grouped_mm_of_any_float(), mode, tracker:
        records = trainer.train()
    device = trainer.device.device
    peak = tracker.get_tracker_snapshot("peak")
    by_kind = next(({getattr(kind, "value", kind): size for kind, size in kinds.items()}
                    for where, kinds in peak.items() if torch_device_matches(where, device)), {})
    return {"device": f"{device} (fake tensors)", "build_s": round(built, 3),
            "seconds": [record.seconds for record in records],
            "peak_memory_bytes": int(by_kind.get("Total", 0)),
            "peak_by_kind_bytes": {kind: int(size) for kind, size in by_kind.items() if kind != "Total"}}


def _step_peak_tracker():
    """torch's ``MemTracker``, keeping the whole rank's peak only. After every op it also
    updates the peak of each module seen so far that is active: thousands of modules for a
    94-layer model, 82 % of a fake step's time (py-spy, Qwen3-235B rank). The rank's peak
    and its breakdown by kind are the figures reported, so that loop is left out."""
    from torch.distributed._tools import mem_tracker

    class StepPeakTracker(mem_tracker.MemTracker):
        def _update_peak_stats(self, peak_state) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot[mem_tracker._TOTAL_KEY]:
                    self._peak_mem[device] = snapshot[mem_tracker._TOTAL_KEY]
                    self._peak_mem_snap[device] = dict(snapshot)

    return StepPeakTracker()


@contextlib.contextmanager
def _grouped_mm_of_any_float():
    """Fake tensors through ``torch._grouped_mm`` in any float dtype, as its CPU and CUDA
    kernels take (torch >= 2.9 falls back to a loop for other than bfloat16; transformers'
    ``grouped_mm`` experts call it with the weights' dtype, float32 masters included): torch's
    meta rule still demands bfloat16 (torch 2.13). Outside bfloat16 the output's shape is
    that rule's for bfloat16 stand-ins (shapes do not depend on the dtype), in the inputs' dtype."""
    import torch
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    op = torch.ops.aten._grouped_mm.default

    def any_float(fake_mode, func, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
            return NotImplemented  # torch's own rule

        def stand_in(tensor):
            return None if tensor is None else torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=torch.bfloat16 if tensor.is_floating_point() else tensor.dtype,
                device="meta")

        with unset_fake_temporarily():
            shaped = func(stand_in(mat_a), stand_in(mat_b), stand_in(offs), stand_in(bias))
            out = torch.empty_strided(shaped.shape, shaped.stride(), dtype=out_dtype or mat_a.dtype, device="meta")
        return FakeTensor(fake_mode, out, mat_a.device)

    if fake_impls._is_op_registered_to_fake_rule(op):  # a torch that fixed it, or entered twice
        yield
        return
    fake_impls.register_op_impl(op)(any_float)
    try:
        yield
    finally:
        fake_impls._deregister_op_impl(op)


def torch_device_matches(tracked, device) -> bool:
    """The tracker keys its figures by ``torch.device``; ``cuda`` and ``cuda:0`` are one."""
    return tracked.type == device.type and (device.index is None or tracked.index in (None, device.index))


@contextlib.contextmanager
def _each_forward_anew(tracker, model):
    """Let torch's tracker see the model called once per micro-batch: it refuses a second
    call of a root module in one session (per-module statistics of an earlier iteration),
    so they are cleared as each forward starts; the peak it keeps runs over all of them.
    A global hook registered before the tracker's own runs before it."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    def clear(module, _inputs):
        if module is model:
            tracker.reset_mod_stats()

    handle = register_module_forward_pre_hook(clear)
    try:
        yield
    finally:
        handle.remove()


def _fake_micro_batches(config) -> dict:
    """At most ``FAKE_MICRO_BATCHES`` micro-batches per step (module docstring); what ran."""
    training, dp = config.training, config.accelerator.parallel_dims.dp
    per_step = training.global_batch_size // (dp * training.micro_batch_size)
    run = min(per_step, FAKE_MICRO_BATCHES)
    training.global_batch_size = run * dp * training.micro_batch_size
    return {"micro_batches_run": run, "micro_batches_per_step": per_step}


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


def _rank_in_own_process(config_path: str, rank: int, steps: int, overrides: list[str],
                         fake_tensors: bool) -> dict | None:
    """One rank's dry run in a fresh process (its memory peak is its own); None, with the
    process's output shown, when it failed."""
    command = [sys.executable, "-m", "hyper_parallel.trainer", "dry-run", "--config", config_path,
               "--rank", str(rank), "--steps", str(steps), *set_arguments(overrides),
               *(["--fake-tensors"] if fake_tensors else [])]
    proc = subprocess.run(command, capture_output=True, text=True)
    reports = [line[len(REPORT_PREFIX):] for line in proc.stdout.splitlines() if line.startswith(REPORT_PREFIX)]
    if proc.returncode != 0 or not reports:
        print(f"error: the dry run of rank {rank} failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}",
              file=sys.stderr)
        return None
    return json.loads(reports[-1])


def _line(report: dict) -> str:
    line = (f"rank {report['rank']}/{report['world']} on {report['device']}: {report['steps']} steps, "
            f"steady step {report['steady_step_s']:.3f}s (built in {report['build_s']:.1f}s), "
            f"peak memory {_size(report['peak_memory_bytes'])}")
    kinds = report.get("peak_by_kind_bytes")
    if kinds:
        line += " (" + ", ".join(f"{kind.lower()} {_size(size)}" for kind, size in kinds.items() if size) + ")"
    if "micro_batches_run" in report:
        line += (f"; {report['micro_batches_run']} of {report['micro_batches_per_step']} micro-batches per step run "
                 "(the peak repeats from the second on)")
    return line


def _size(size: int) -> str:
    """Bytes as GiB, or MiB below one GiB (a tiny model's figures are not all zeros)."""
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.2f} MiB"
