"""Ranks as threads of this test process, joined by torch's threaded process group (with
point-to-point sends), as verify's thread mode runs them."""

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from hyper_parallel.codegen.check import threaded_p2p


def run_ranks(world: int, body) -> list:
    """``body(rank)`` on ``world`` threads; its results by rank, or the first error a rank
    raised (its process group's start included). Each thread is checked to be its rank."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    ProcessLocalGroup.reset()  # no termination left by an earlier test's failing world
    _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    store, results, errors = dist.HashStore(), [None] * world, []

    def worker(rank):
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store,
                                    timeout=timedelta(seconds=60))
            results[rank] = (dist.get_rank(), body(rank))
        except Exception as exc:  # noqa: BLE001  (reported below, the other ranks woken)
            errors.append(exc)
            ProcessLocalGroup.exception_handle(exc)

    threads = [threading.Thread(target=worker, args=(rank,), daemon=True) for rank in range(world)]
    try:
        with threaded_p2p.installed():
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()
    assert not any(thread.is_alive() for thread in threads), "a rank did not finish"
    if errors:
        raise errors[0]
    assert [entry[0] for entry in results] == list(range(world)), results  # each thread its own rank
    return [entry[1] for entry in results]
