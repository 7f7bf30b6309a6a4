"""``python -m MODULE ARGS...`` as a fork of this process instead of a fresh interpreter.

Verify and preflight launch their ranks with ``python -m`` (``forked_torchrun``, or
verify's threaded worker). A fresh interpreter spends about 5 CPU-seconds importing
torch and transformers before it does anything, and the build tool that launches it has
imported both already (derive and verify's reference run need them). A fork of the build
tool starts with them imported: the tiny recipe's generate loses two such imports.

The fork behaves as the subprocess did: a session of its own (``kill_tree`` ends it and
its group), killed by the kernel when this process dies (``guard.die_with``), its
output in the launch's log, the launch's environment, stdin from /dev/null, and no file
descriptor of this process but those (a pipe the launch's watcher waits on must see its
end of file when this process dies). It runs the module as ``python -m`` would
(``runpy.run_module``) and leaves with ``os._exit``: nothing of this process's teardown
runs twice.

``fork_refusal`` says when a fork would not be the same thing, and the launch then starts
a fresh interpreter as before: other Python threads running (a lock one of them holds
would stay held in the fork), a process group or an accelerator already set up here (a
fork inherits them half-working), a command that is not ``python -m``, or
``HYPER_PARALLEL_LAUNCH=spawn`` (to compare, or to rule the fork out).
"""

import contextlib
import gc
import io
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from hyper_parallel.launch.guard import die_with

LAUNCH_ENV = "HYPER_PARALLEL_LAUNCH"  # "spawn": always a fresh interpreter


def fork_refusal(cmd: list[str]) -> str | None:
    """Why ``cmd`` may not run as a fork of this process, or None when it may."""
    if os.environ.get(LAUNCH_ENV) == "spawn":
        return f"{LAUNCH_ENV}=spawn"
    if not hasattr(os, "fork") or sys.platform != "linux":
        return "no fork() with PR_SET_PDEATHSIG here"
    if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m":
        return "not a `python -m MODULE` command"
    if threading.active_count() > 1:
        return "other Python threads are running"
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return "a process group is initialized here"
    torch = sys.modules.get("torch")
    for accelerator in ("cuda", "npu", "xpu", "mps"):
        backend = getattr(torch, accelerator, None) if torch is not None else None
        if backend is not None and getattr(backend, "is_initialized", lambda: False)():
            return f"{accelerator} is initialized here"
    return None


class ForkedModule:
    """A fork of this process running ``python -m module args``; answers what the launch
    asks of a ``subprocess.Popen``: ``pid``, ``returncode``, ``poll``, ``wait``, ``kill``."""

    def __init__(self, module: str, args: list[str], *, env: dict[str, str], log: Path):
        parent = os.getpid()
        gc.collect()  # no garbage of ours for the fork to finalize (see _become)
        sys.stdout.flush()
        sys.stderr.flush()
        self.args = [sys.executable, "-m", module, *args]
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            os._exit(_become(parent, module, args, env, log))

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _become(parent: int, module: str, args: list[str], env: dict[str, str], log: Path) -> int:
    """In the fork: become the launch, run the module, return its exit code."""
    try:
        os.setsid()
        die_with(parent)
        # Objects of the parent's are never finalized here: one closing a descriptor number
        # that _own_descriptors has handed to the log meanwhile would close the log.
        gc.freeze()
        _own_descriptors(log)
        for number in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(number, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        torch = sys.modules.get("torch")
        if torch is not None and env.get("OMP_NUM_THREADS", "").isdigit():
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # read at import; this one imported long ago
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as exc:
        code = exc.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            return 1
        return code or 0
    except BaseException:  # noqa: BLE001 - reported as `python -m` would, then the fork exits
        traceback.print_exc()
        return 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()


def _own_descriptors(log: Path) -> None:
    """stdin from /dev/null, stdout and stderr into ``log``, every other descriptor closed."""
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.closerange(3, _max_descriptor())
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)


def _max_descriptor() -> int:
    try:
        return max(int(name) for name in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return os.sysconf("SC_OPEN_MAX")
