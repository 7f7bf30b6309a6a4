"""How verify runs a layout: rank processes or threads, and how many steps. Import-light
(the install stage's up-to-date check reads it on every no-op run, and codegen_meta.json
records it), so the verify machinery itself is imported only when verify runs."""

import os

from hyper_parallel.errors import HyperParallelError

STEPS = 2  # training steps verify compares (an AdamW step after the first shows a wrong gradient scale)
MAX_PROCS_ENV = "HYPER_PARALLEL_VERIFY_MAX_PROCS"


class VerifyError(RuntimeError, HyperParallelError):
    """The generated model does not train like one device; the message says where."""


def max_processes() -> int:
    """The most rank processes verify starts on this host (above it: threads)."""
    raw = os.environ.get(MAX_PROCS_ENV)
    if raw is None:
        return 2 * (os.cpu_count() or 1)
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise VerifyError(f"${MAX_PROCS_ENV}: expected a positive integer, got {raw!r}")
    return value


MAX_SIMULATED_RANKS = 4096  # threads of one process: each holds a probe model and a stack


def verify_mode(world: int) -> str:
    """torchrun processes up to the cap (also from a training job's rank 0), threads above it."""
    if world <= max_processes():
        return "torchrun"
    if world > MAX_SIMULATED_RANKS:
        raise VerifyError(f"world size {world}: verify simulates at most {MAX_SIMULATED_RANKS} ranks in one process "
                          f"(and starts at most {max_processes()} processes, ${MAX_PROCS_ENV}); this layout cannot "
                          f"be verified here")
    return "threads"


def verified_record(world: int) -> dict:
    """What codegen_meta.json says about verify for a world size: how it runs, never its
    figures (those move with float noise from one machine to another)."""
    return {"mode": verify_mode(world), "world": world, "steps": STEPS}
