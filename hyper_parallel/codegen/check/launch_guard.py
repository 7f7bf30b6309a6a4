"""Watch a launching process; if it dies, end the launch it started and remove its scratch.

    python -m hyper_parallel.codegen.check.launch_guard --root PID --scratch DIR

Started by ``RankLaunch`` with a pipe on stdin, in a session of its own (a signal to the
launcher's process group does not reach it). While the pipe is open it records the
launch's process tree every quarter second — torchrun's ranks sit in sessions of their
own, and would be re-parented to init once torchrun is gone. ``done`` on the pipe: the
launcher ended the launch itself, leave. End of file without it: the launcher died (a
SIGKILL runs no ``finally``), so kill every recorded process and remove the scratch folder.
Imports psutil only.
"""

import argparse
import os
import select
import shutil
import sys

import psutil

POLL_S = 0.25


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyper_parallel.codegen.check.launch_guard")
    parser.add_argument("--root", type=int, required=True, help="pid of the launched process")
    parser.add_argument("--scratch", required=True, help="the launch's scratch folder")
    args = parser.parse_args(argv)
    known: dict[int, psutil.Process] = {}
    stdin = sys.stdin.fileno()
    while True:
        _record_tree(args.root, known)
        ready, _, _ = select.select([stdin], [], [], POLL_S)
        if not ready:
            continue
        data = os.read(stdin, 64)
        if data.startswith(b"done"):
            return 0
        if not data:  # the launcher is gone and never said done
            _kill(known)
            shutil.rmtree(args.scratch, ignore_errors=True)
            return 0


def _record_tree(root: int, known: dict[int, psutil.Process]) -> None:
    """Add the root and its descendants, and the descendants of every process seen before."""
    sources = [root, *known]
    for pid in sources:
        try:
            process = known.get(pid) or psutil.Process(pid)
            known.setdefault(pid, process)
            for child in process.children(recursive=True):
                known.setdefault(child.pid, child)
        except psutil.Error:
            continue


def _kill(known: dict[int, psutil.Process]) -> None:
    """SIGKILL every recorded process still running (psutil checks the pid was not reused)."""
    for process in known.values():
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(known.values()), timeout=5)


if __name__ == "__main__":
    sys.exit(main())
