"""How a test's torchrun worker leaves once it has written its result."""

from hyper_parallel.distributed.rank_exit import exit_rank


def leave_after_barrier(dist, code: int = 0) -> None:
    """Meet the other ranks, then leave without process-group and interpreter teardown,
    which now and then aborts a rank (SIGABRT, "terminate called without an active
    exception") after all the work is done, failing the launch (see rank_exit)."""
    dist.barrier()
    exit_rank(code)
