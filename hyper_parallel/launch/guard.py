"""Nothing of a run outlives it: end its processes and remove its scratch when it dies.

    python -m hyper_parallel.launch.guard watch --parent PID --scratch DIR
    python -m hyper_parallel.launch.guard exec --parent PID -- COMMAND...

``watch`` is started by ``scratch_dir`` with a pipe on stdin, in a session of its own (a
signal to the run's process group does not reach it). While the pipe is open it records
the parent's descendants every second — torchrun's ranks sit in sessions of their
own and would be re-parented to init once torchrun is gone. ``done`` on the pipe: the run
cleaned up itself, leave. End of file without it: the parent died (a SIGKILL runs no
``finally``), so kill every recorded process and every process whose environment names
the parent as its launch owner (``HP_LAUNCH_OWNER``, set by ``RankLaunch`` and inherited
by torchrun's ranks: a rank started between two polls was never recorded), and remove
the scratch folder.

``exec`` is how a launch starts: it asks the kernel to SIGKILL it when its parent dies
(``PR_SET_PDEATHSIG``, kept across ``execv``), then becomes COMMAND. That covers a launch
the watcher had no time to see. Imports psutil only (``watch``).
"""

import argparse
import ctypes
import os
import select
import shutil
import signal
import sys

# Each poll walks /proc (about 1% of a core at this rate); what starts and loses its parents
# between two polls is found at the end by its environment (HP_LAUNCH_OWNER).
POLL_S = 1.0
_PR_SET_PDEATHSIG = 1
OWNER_ENV = "HP_LAUNCH_OWNER"  # the pid of the process whose launch started this one


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyper_parallel.launch.guard")
    sub = parser.add_subparsers(dest="mode", required=True)
    watch = sub.add_parser("watch", help="clean up after the parent when it dies")
    watch.add_argument("--parent", type=int, required=True)
    watch.add_argument("--scratch", required=True, help="the run's scratch folder")
    run = sub.add_parser("exec", help="become COMMAND, killed when the parent dies")
    run.add_argument("--parent", type=int, required=True)
    run.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.mode == "exec":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        return exec_with_parent(args.parent, command)
    return watch_parent(args.parent, args.scratch)


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; a no-op
    elsewhere): a helper process never outlives the one that started it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with(parent: int) -> None:
    """Die with ``parent``, this process's parent (Linux; elsewhere the watcher alone
    covers it); leave now if it is gone already (it died before the request took effect)."""
    die_with_parent()
    if os.getppid() != parent:
        os._exit(1)


def exec_with_parent(parent: int, command: list[str]) -> int:
    """Die with ``parent``, then exec."""
    die_with(parent)
    os.execv(command[0], command)
    return 1  # not reached


def watch_parent(parent: int, scratch: str) -> int:
    import psutil

    known: dict[int, psutil.Process] = {}
    stdin = sys.stdin.fileno()
    while True:
        _record_descendants(parent, known)
        ready, _, _ = select.select([stdin], [], [], POLL_S)
        if not ready:
            continue
        data = os.read(stdin, 64)
        if data.startswith(b"done"):
            return 0
        if not data:  # the parent is gone and never said done
            for _ in range(2):  # a rank forked while the first pass ran is found by the second
                _record_owned(parent, known)
                _kill(known)
            shutil.rmtree(scratch, ignore_errors=True)
            return 0


def _record_descendants(parent: int, known: dict) -> None:
    """Add the parent's descendants (this watcher aside) and those of every process seen
    before: a rank re-parented to init is still found through the record."""
    import psutil

    for pid in [parent, *known]:
        try:
            process = known.get(pid) or psutil.Process(pid)
            for child in process.children(recursive=True):
                if child.pid != os.getpid():
                    known.setdefault(child.pid, child)
        except psutil.Error:
            continue


def _record_owned(parent: int, known: dict) -> None:
    """Add every process of this user whose environment names ``parent`` as its launch
    owner: what the polls missed (a rank that started and lost its parents in between)."""
    import psutil

    owner = str(parent)
    for process in psutil.process_iter(["pid", "uids"]):
        try:
            if process.pid == os.getpid() or process.info["uids"].real != os.getuid():
                continue
            if process.environ().get(OWNER_ENV) == owner:
                known.setdefault(process.pid, process)
        except psutil.Error:
            continue


def _kill(known: dict) -> None:
    """SIGKILL every recorded process still running (psutil checks the pid was not reused)."""
    import psutil

    for process in known.values():
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(known.values()), timeout=5)


if __name__ == "__main__":
    sys.exit(main())
