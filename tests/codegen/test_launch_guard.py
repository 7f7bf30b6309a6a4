"""The launch guard ends what a SIGKILLed run started, including a rank it never saw as a
descendant: one that lost its parents before the watcher's first poll (torchrun killed
between forking a rank and the next poll)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from hyper_parallel.launch.ranks import scratch_dir
from hyper_parallel.launch.guard import OWNER_ENV

# The run: starts an orphaned "rank" (double fork, own session) carrying the owner mark,
# prints its pid, then opens a scratch folder (starting the watcher after the rank is
# already re-parented, so no poll can see it as a descendant) and waits to be killed.
RUN = textwrap.dedent("""
    import os, subprocess, sys, time
    from hyper_parallel.launch.ranks import scratch_dir
    env = {**os.environ, "%(owner)s": str(os.getpid())}
    middle = subprocess.Popen([sys.executable, "-c",
        "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
        "start_new_session=True); print(p.pid, flush=True)"], env=env, stdout=subprocess.PIPE, text=True)
    rank = int(middle.stdout.readline())
    middle.wait()
    with scratch_dir("guardtest") as path:
        print(rank, path, flush=True)
        time.sleep(120)
""") % {"owner": OWNER_ENV}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigkilled_run_leaves_no_rank_the_watcher_never_saw(tmp_path):
    run = subprocess.Popen([sys.executable, "-c", RUN], stdout=subprocess.PIPE, text=True)
    rank_text, scratch = run.stdout.readline().split()
    rank = int(rank_text)
    try:
        assert psutil.Process(rank).ppid() != run.pid  # re-parented: not a descendant of the run
        assert os.path.isdir(scratch)
        time.sleep(1.0)  # the watcher has polled a few times and recorded nothing
        run.send_signal(signal.SIGKILL)
        run.wait()
        deadline = time.monotonic() + 10
        while (_alive(rank) or os.path.isdir(scratch)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(rank), "the rank outlived its killed run"
        assert not os.path.isdir(scratch), "the scratch folder outlived its killed run"
    finally:
        if _alive(rank):
            os.kill(rank, signal.SIGKILL)


def test_a_run_that_ends_normally_keeps_processes_it_does_not_own():
    """``done`` on the pipe: the watcher leaves without killing anything."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 env={**os.environ, OWNER_ENV: str(os.getpid())})
    try:
        with scratch_dir("guardtest") as path:
            assert path.is_dir()
        assert not path.exists()
        time.sleep(0.5)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
