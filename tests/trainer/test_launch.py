"""``trainer launch`` (issue 56): the recipe's ranks started with no torchrun arguments typed,
a bad ``--set`` refused before any rank starts, and a rank that fails mid-run named in the
launch's last line without the elastic agent's traceback."""

import signal
import subprocess
import sys

import psutil
import pytest

from tests.project_fixtures import REPO, TINY_RECIPE, run

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _launch(*extra: str) -> list[str]:
    return [sys.executable, "-m", "hyper_parallel.trainer", "launch", "--config", TINY_RECIPE, *extra]


def test_launch_runs_the_recipes_world_with_its_set_items():
    proc = run(_launch("--set", "training.steps=3"), cwd=REPO, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "layout: tp 2 over 2 rank(s) on cpu" in out and "step 3/3" in out and "step 4/" not in out
    assert "OMP_NUM_THREADS" not in out and "torch/distributed/run.py" not in out  # the agent says nothing


@pytest.mark.parametrize("item, said", [
    ("training.stepz=3", "unknown key 'training.stepz'"),
    ("training.steps=three", "training.steps: expected int, got str 'three'"),
    ("training.steps", "--set 'training.steps': expected KEY=VALUE"),
])
def test_a_bad_set_item_is_refused_before_any_rank_starts(item, said):
    proc = run(_launch("--set", item), cwd=REPO, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1 and said in proc.stderr, proc.stderr


def test_a_rank_that_dies_mid_run_is_the_last_line():
    proc = subprocess.Popen(_launch("--set", "training.steps=100000"), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("step 2/"):
                break
        ranks = [child for child in psutil.Process(proc.pid).children(recursive=True)
                 if child.environ().get("RANK") == "1" and "hyper_parallel.trainer" in " ".join(child.cmdline())]
        assert len(ranks) == 1, ranks
        ranks[0].send_signal(signal.SIGKILL)
        out = proc.stdout.read()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
    assert proc.returncode == 1
    assert out.strip().splitlines()[-1] == "error: rank 1 died of signal SIGKILL", out[-2000:]
    assert "ChildFailedError" not in out and "Root Cause" not in out
