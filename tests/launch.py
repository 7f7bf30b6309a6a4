"""One way for a test to launch ranks under torchrun, and to check that they ran.

The tests that need real process groups (gloo on CPU) start ``torch.distributed.run`` as
a subprocess. Each used to spell out the command, its environment, its timeout and its
failure message by hand, and the copies drifted: some set ``OMP_NUM_THREADS`` and kept
the caller's ``WORLD_SIZE``/``RANK``/``MASTER_*``, others went through
``tests.project_fixtures.run``, and each cut its own tail of the output on failure.
Every launch now goes through ``tests.project_fixtures.run`` (``OMP_NUM_THREADS=1``, so
ranks on a small machine do not oversubscribe it; inherited rendezvous variables
dropped) with ``--standalone`` (a local rendezvous on a free port).

A module target (``-m tests...``, ``-m hyper_parallel.trainer``) runs under
``forked_torchrun``, as verify's ranks do: torchrun itself, its ranks forked from a
launcher that imported the target's modules (and ``preload``) once, instead of each rank
importing torch and transformers again. ``plain=True`` and script targets start plain
torchrun, each rank a fresh interpreter, as a user's launch does
(tests/families/test_fix_tied_embeddings.py trains that way).
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

from hyper_parallel.launch.forked_torchrun import torchrun_command
from tests.project_fixtures import run


def torchrun(target: list[str], cwd: Path, *, nproc: int = 2, env: dict | None = None, timeout: float = 600,
             preload: tuple[str, ...] = (), plain: bool = False) -> subprocess.CompletedProcess:
    """Run ``target`` (``["-m", "pkg.worker", *args]`` or ``[script, *args]``) on ``nproc``
    local ranks; ``env`` is added to the environment. Returns the finished process, its
    output captured as text; the caller checks it (``assert_ran`` or its own assertions)."""
    if target[0] == "-m" and not plain:
        command = torchrun_command(nproc, target[1], target[2:], preload=["transformers", *_entry(target[1]), *preload])
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   *target]
    return run(command, cwd, env=env, timeout=timeout)


def _entry(module: str) -> list[str]:
    """What ``-m module`` imports first: the module, or a package's ``__main__``."""
    spec = importlib.util.find_spec(module)
    return [f"{module}.__main__" if spec is not None and spec.submodule_search_locations is not None else module]


def assert_ran(proc: subprocess.CompletedProcess, tail: int = 4000) -> None:
    """The launch exited 0; otherwise fail showing the last ``tail`` characters of its
    stdout and of its stderr (a rank's traceback is usually near the end of stderr)."""
    assert proc.returncode == 0, (f"torchrun failed (exit {proc.returncode}):\n"
                                  f"{proc.stdout[-tail:]}\n{proc.stderr[-tail:]}")
