"""A launch's ``python -m`` command runs as a fork of the launching process
(launch/forked_module.py) and behaves as the fresh interpreter did: the launch's
environment and log, a session of its own, no descriptor of the launcher's, its exit
code, dead with its parent; and it falls back to a fresh interpreter where a fork would
not be the same thing.

Each launch starts from a launcher process of its own: pytest-xdist's worker runs threads,
where a fork is refused."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil

from hyper_parallel.launch.forked_module import LAUNCH_ENV, fork_refusal

WORKER = "tests.forked_module_worker"

# The launcher: imports torch (with 2 threads, as the build tool does), holds a pipe's write
# end, sets a rendezvous variable a launch must drop, launches WORKER ARGS and reports.
LAUNCHER = textwrap.dedent("""
    import json, os, sys
    import torch
    torch.set_num_threads(2)
    from pathlib import Path
    from hyper_parallel.launch.ranks import RankLaunch
    from hyper_parallel.launch.forked_module import ForkedModule
    out, args = Path(sys.argv[1]), sys.argv[2:]
    read_end, write_end = os.pipe()
    os.environ["RANK"] = "7"
    launch = RankLaunch([sys.executable, "-m", %(worker)r, *args], log=out.with_suffix(".log"))
    print(launch.proc.pid, flush=True)
    code = launch.proc.wait(timeout=120)
    out.write_text(json.dumps({"launcher": os.getpid(), "write_end": write_end, "returncode": code,
                               "forked": isinstance(launch.proc, ForkedModule), "output": launch.output()}))
""") % {"worker": WORKER}


def _launch(tmp_path, *args: str, env: dict | None = None) -> dict:
    out = tmp_path / "launch.json"
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, str(out), *args], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_the_launch_is_a_fork_with_the_launch_environment_and_log(tmp_path):
    report_path = tmp_path / "report.json"
    launch = _launch(tmp_path, "report", str(report_path))
    report = json.loads(report_path.read_text())
    assert launch["forked"] and launch["returncode"] == 0
    assert report["ppid"] == launch["launcher"] and report["sid"] == report["pid"]  # own session
    assert report["torch_imported"], "the fork should find torch imported (the worker does not import it)"
    assert report["torch_threads"] == 1, "OMP_NUM_THREADS=1 of the launch should reach torch in the fork"
    assert report["env"]["OMP_NUM_THREADS"] == "1" and report["env"]["HP_LAUNCH_OWNER"] == str(launch["launcher"])
    assert "RANK" not in report["env"], "a rendezvous variable of the launcher reached the launch"
    assert launch["write_end"] not in report["fds"] and max(report["fds"]) <= 3, report["fds"]
    assert report["name"] == "__main__" and report["argv"][1:] == ["report", str(report_path)]
    assert launch["output"].strip() == "reported"


def test_exit_codes_and_errors_come_back_as_from_a_fresh_interpreter(tmp_path):
    assert _launch(tmp_path, "exit", "3")["returncode"] == 3
    failed = _launch(tmp_path, "raise")
    assert failed["returncode"] == 1 and "RuntimeError: the worker failed on purpose" in failed["output"]
    assert failed["forked"]


def test_spawn_is_used_where_asked_or_where_a_fork_would_differ(tmp_path):
    report_path = tmp_path / "report.json"
    launch = _launch(tmp_path, "report", str(report_path), env={LAUNCH_ENV: "spawn"})
    report = json.loads(report_path.read_text())
    assert not launch["forked"] and not report["torch_imported"] and "RANK" not in report["env"]
    assert fork_refusal([sys.executable, "script.py"]) == "not a `python -m MODULE` command"
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert fork_refusal([sys.executable, "-m", WORKER]) == "other Python threads are running"
    finally:
        stop.set()
        thread.join()


def test_the_fork_dies_with_its_launcher(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "launch.json"), "sleep", "120"],
                                stdout=subprocess.PIPE, text=True)
    fork = int(launcher.stdout.readline())
    try:
        assert psutil.Process(fork).ppid() == launcher.pid
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while _alive(fork):
            assert time.monotonic() < deadline, "the fork outlived its killed launcher"
            time.sleep(0.1)
    finally:
        if _alive(fork):
            os.kill(fork, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
