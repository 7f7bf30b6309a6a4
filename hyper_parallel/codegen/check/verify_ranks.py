"""How verify's ranks run: one process each under torchrun, or every rank a thread of one
process over torch's threaded process group; each rank's body (verify_worker's
``run_rank``) guarded so that a failure names the rank, the module it was in and the plan
entry that module took, and reported without a collective (a silent rank is named by the
launcher from the last phase it reported)."""

import os
import threading
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from hyper_parallel.codegen.check import threaded_p2p
from hyper_parallel.distributed.rank_exit import exit_rank
from hyper_parallel.launch.ranks import RankFiles, join_process_group

# A rank's body: run_rank(job, running, finished), which keeps the modules running and finished
RankBody = Callable[[dict[str, Any], list[str], list[str]], None]


def run_torchrun(job: dict[str, Any], rank_body: RankBody) -> int:
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    if not join_process_group(RankFiles(job["rank_files"]), rank, lambda: dist.init_process_group(
            "gloo", timeout=timedelta(seconds=job["timeout_s"])), job["timeout_s"]):
        exit_rank(1)
    error = _guarded_rank(job, rank_body)
    # Each rank reports on its own (no collective that a silent rank could block), so the
    # launcher can name a rank that never reported.
    if error:
        RankFiles(job["rank_files"]).report_error(rank, error)
    else:
        progress(job, "done")
        try:
            dist.barrier()  # nobody leaves while a peer may still be receiving from it
        except RuntimeError:
            pass
    exit_rank(1 if error else 0)


def progress(job: dict[str, Any], phase: str) -> None:
    """Record how far this rank got (the launcher names the last phase of a silent rank)."""
    import torch.distributed as dist

    if job["mode"] == "torchrun":
        RankFiles(job["rank_files"]).report_progress(dist.get_rank(), phase)


def run_threads(job: dict[str, Any], world: int, rank_body: RankBody) -> int:
    """Every rank a thread; the first failing rank wakes the others (they raise too)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    store = dist.HashStore()
    errors: list[tuple[int, str]] = []
    load_bundle_module(job)  # import once, before the threads share it

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store,
                                timeout=timedelta(seconds=job["timeout_s"]))
        error = _guarded_rank(job, rank_body)
        if error:
            errors.append((rank, error))
            ProcessLocalGroup.exception_handle(RuntimeError(error))

    threads = [threading.Thread(target=worker, args=(rank,), daemon=True) for rank in range(world)]
    with threaded_p2p.installed():  # pipeline stages send to each other
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=job["timeout_s"])
    silent = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    _uninstall_threaded_pg()
    if silent:
        errors.append((silent[0], f"rank {silent[0]}: did not finish within {job['timeout_s']}s "
                                  f"(ranks {silent} still running)"))
    if errors:
        # The first error is the cause; the others are woken ranks raising after it.
        Path(job["error"]).write_text(sorted(errors, key=lambda e: "terminat" in e[1].lower())[0][1])
        return 1
    return 0


def _guarded_rank(job: dict[str, Any], rank_body: RankBody) -> str | None:
    import torch.distributed as dist

    rank = dist.get_rank()
    running: list[str] = []
    finished: list[str] = []
    try:
        rank_body(job, running, finished)
        return None
    except Exception as exc:
        detail = traceback.format_exc() if os.environ.get("HYPER_PARALLEL_TRACEBACK") else ""
        where = ""
        if running:
            where = f" in {running[-1]}{_plan_key_of(job, running[-1])}"
            # What fed it: the planned modules that ran inside the innermost running
            # module that had any (the crashing module, or its block: q_norm -> self_attn).
            for outer in reversed(running):
                inside = [name for name in finished if name.startswith(outer + ".") and name != running[-1]]
                if inside:
                    where += f"; planned modules that ran inside {outer} first: " + "; ".join(
                        f"{name}{_plan_key_of(job, name)}" for name in dict.fromkeys(inside))
                    break
        return f"rank {rank}: {type(exc).__name__}: {exc}{where}{detail}"


def _plan_key_of(job: dict[str, Any], fqn: str) -> str:
    """The plan entry that was applied to ``fqn``, or to its nearest planned parent."""
    from hyper_parallel.distributed.name_match import plan_entry_for

    plan = load_bundle_module(job).HYPER_PARALLEL_PLAN["modules"]
    name = fqn
    while True:
        found = plan_entry_for(name, plan)
        if found is not None:
            return f" (plan entry {found[0]!r}: {brief_entry(found[1])})"
        if not name:
            return " (no plan entry)"
        name = name.rpartition(".")[0]


def brief_entry(entry: dict[str, Any] | str) -> str | dict[str, Any]:
    """An entry as the generated file spells it (one line), for a diagnosis to quote."""
    from hyper_parallel.protocols.sharding_json import entry_line, full_entry

    return entry_line(full_entry(entry))


def track_running(model, plan: dict[str, Any], running: list[str], finished: list[str]) -> None:
    """Keep the innermost module whose forward is running and the last module with a plan
    entry of its own to finish, so a crash names both."""
    from hyper_parallel.distributed.name_match import plan_entry_for

    def enter(name):
        def hook(module, args):
            running.append(name)
        return hook

    def leave(name, planned):
        def hook(module, args, output):
            if running:
                running.pop()
            if planned:
                finished.append(name)
        return hook

    for name, module in model.named_modules():
        module.register_forward_pre_hook(enter(name))
        module.register_forward_hook(leave(name, plan_entry_for(name, plan) is not None))


def load_bundle_module(job: dict[str, Any]):
    from hyper_parallel.runtime.loader import load_bundle_module

    return load_bundle_module(job["bundle_dir"], job["modeling_file"], job["bundle_key"], job["files"])
