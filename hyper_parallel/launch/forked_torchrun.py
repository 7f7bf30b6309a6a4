"""torchrun whose ranks are forked from a launcher that imported the heavy modules first.

    python -m hyper_parallel.launch.forked_torchrun --preload MOD[,MOD...] -- -m WORKER ARGS...

Every rank of verify and preflight imports torch, transformers and the model's modeling
module before it does a second of work: about 7 CPU-seconds per rank on a small machine,
most of what a tiny check costs. Here the launcher imports them once and then runs
torchrun itself (``torch.distributed.run.main``, the same agent, rendezvous and failure
report) with ``--start-method fork --run-path``: each rank is a fork of the launcher and
finds the modules already imported. A preload that fails to import is skipped; the rank
then imports it itself and reports the error as it would have.

Each rank asks the kernel to kill it when the launcher dies (``guard.die_with``): when
the launcher is itself a fork of the build tool (``forked_module``), its ranks carry no
launch-owner mark in their environment for the guard's watcher to find them by.

A rank, forked or not, leaves with ``distributed.rank_exit.exit_rank``, which knows the
difference (this launcher sets ``FORKED_ENV``).

A fork copies only the forking thread, and any lock another thread of the agent held at
that moment stays held in the rank for good. One such lock was seen twice: glibc's
resolver lock. A rank hung forever inside TCPStore's connect in ``init_process_group``,
once in ``getaddrinfo`` of the host's name, once in ``getnameinfo`` of 127.0.0.1 (c10d
formats the address it connects to), while its peers timed out waiting for it (py-spy,
2026-12-05). The agent's store thread looks up each connecting rank's address the same
way, so no rank goes on before the agent has forked them all (``ForkGate``).

A launch on one host (``--standalone``: verify's, preflight's, the tests') gives its ranks
numeric loopback addresses, so they need no name lookup: ``--local-addr 127.0.0.1``
(``torchrun_command``; their MASTER_ADDR) and gloo's loopback interface
(``GLOO_SOCKET_IFNAME`` unless set; without it gloo resolves the host's name to pick one).
A launch over several nodes keeps its addresses and interfaces.
"""

import argparse
import importlib
import importlib.util
import os
import select
import sys
import time

from hyper_parallel.distributed.rank_exit import FORKED_ENV
from hyper_parallel.launch.guard import die_with

LOOPBACK_ADDRESS = "127.0.0.1"
GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"


def torchrun_command(world: int, worker_module: str, worker_args: list[str], preload: list[str]) -> list[str]:
    """The command line that starts ``world`` forked ranks of ``worker_module``."""
    return [sys.executable, "-m", __name__, "--preload", ",".join(preload), "--",
            # --standalone: torchrun picks a free rendezvous port itself (no check-then-use race).
            "--standalone", f"--local-addr={LOOPBACK_ADDRESS}", f"--nproc_per_node={world}",
            "-m", worker_module, *worker_args]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyper_parallel.launch.forked_torchrun",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--preload", default="", help="comma-separated modules to import before forking")
    parser.add_argument("torchrun_args", nargs=argparse.REMAINDER,
                        help="torchrun's arguments, ending in -m WORKER ARGS...")
    args = parser.parse_args(argv)
    torchrun_args = args.torchrun_args[1:] if args.torchrun_args[:1] == ["--"] else args.torchrun_args
    at = torchrun_args.index("-m") if "-m" in torchrun_args else len(torchrun_args)
    if at + 1 >= len(torchrun_args):
        parser.error("expected torchrun arguments ending in -m WORKER ARGS...")
    worker = _script_of(torchrun_args[at + 1])
    if worker is None:
        parser.error(f"no worker module {torchrun_args[at + 1]!r}")
    for name in filter(None, args.preload.split(",")):
        try:
            importlib.import_module(name)
        except Exception:  # the rank imports it again and reports the error itself
            pass
    os.environ[FORKED_ENV] = "1"
    loopback = loopback_interface() if "--standalone" in torchrun_args[:at] else None  # one host: no lookups
    if loopback is not None:
        os.environ.setdefault(GLOO_INTERFACE_ENV, loopback)
    agent = os.getpid()
    os.register_at_fork(after_in_child=lambda: die_with(agent))
    ranks = _ranks_per_node(torchrun_args[:at])
    if ranks:
        gate = ForkGate(ranks)
        os.register_at_fork(after_in_parent=gate.forked, after_in_child=gate.wait)
    from torch.distributed.run import main as torchrun

    torchrun([*torchrun_args[:at], "--start-method=fork", "--run-path", worker, *torchrun_args[at + 2:]])
    return 0


class ForkGate:
    """Ranks start their work only once the agent has forked all of them. A rank's first
    connection makes the agent's store thread look up its address (glibc's resolver lock,
    ``getnameinfo``); a rank forked meanwhile inherits that lock held, and hangs for good
    on its own first lookup. With the gate, nothing connects while the agent forks.

    A pipe: each rank reads it until its end of file, which comes when the agent closes
    its end after the last fork (or dies); a rank closes its own copy of that end first.
    ``wait`` gives up after ``timeout_s`` (an agent that never forks them all)."""

    def __init__(self, ranks: int, timeout_s: float = 120.0):
        self.agent, self.left, self.timeout_s = os.getpid(), ranks, timeout_s
        self.read_end, self.write_end = os.pipe()

    def forked(self) -> None:
        """After a fork, in the agent: the last rank opens the gate."""
        if os.getpid() != self.agent or self.write_end is None:
            return
        self.left -= 1
        if self.left <= 0:
            os.close(self.write_end)
            self.write_end = None

    def wait(self) -> None:
        """After a fork, in the rank: wait for the gate (once; a rank's own forks pass)."""
        if self.write_end is not None:
            os.close(self.write_end)
            self.write_end = None
        if self.read_end is None:
            return
        deadline = time.monotonic() + self.timeout_s
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.read_end], [], [], left)
            if ready and not os.read(self.read_end, 1):
                break
        os.close(self.read_end)
        self.read_end = None


def _ranks_per_node(torchrun_args: list[str]) -> int:
    """``--nproc_per_node`` / ``--nproc-per-node`` as a number (0 when absent or not one)."""
    for index, arg in enumerate(torchrun_args):
        for flag in ("--nproc_per_node", "--nproc-per-node"):
            if arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            elif arg == flag and index + 1 < len(torchrun_args):
                value = torchrun_args[index + 1]
            else:
                continue
            return int(value) if value.isdigit() else 0
    return 0


def loopback_interface() -> str | None:
    """The name of the network interface that holds 127.0.0.1 ("lo" on Linux), or None."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(address.address == LOOPBACK_ADDRESS for address in addresses):
            return name
    return None


def _script_of(module: str) -> str | None:
    """The file ``python -m module`` runs: the module's own, or a package's ``__main__``."""
    try:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{module}.__main__")
    except (ImportError, ValueError):  # a missing parent package, an empty name
        return None
    return spec.origin if spec is not None and spec.origin else None


if __name__ == "__main__":
    sys.exit(main())
