"""SIGKILL at random instants in every stage (issue: trust boundary). The recipe toggles
between two layouts every round, so each round rebuilds every stage; each trial starts
``generate`` and kills it at a random instant inside one chosen stage. After every kill:
the bundle is the complete old or the complete new one, and within a few seconds no
process and no scratch folder of the killed run is left (its guard ends them). At the
end, one more generate recovers the original bundle byte for byte and leaves no temp
file or staging folder behind."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from hyper_parallel.codegen.spec.types import STAGES
from tests.pipeline.pipeline_helpers import BUNDLE, ENV, copy_project, generated_tiny_project
from tests.project_fixtures import TINY_RECIPE, bundle_bytes, cli, orphaned_scratch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

TRIALS_PER_STAGE = 1  # 8 stages: 8 kills, one inside every stage (the suite's 20-minute budget;
# each round runs the whole pipeline, verify and preflight included)
ATTEMPTS = 5  # runs per trial until the kill lands inside the stage (a fast stage may end first),
# each drawing in half the window of the one before, so a stage shorter than its window is hit
# How long after a stage starts to kill at most (about the stage's own duration here;
# resolve's window starts with the process).
KILL_WINDOW_S = {"resolve": 1.0, "derive": 6.0, "freeze": 0.3, "emit": 0.5, "diff": 0.3, "verify": 10.0,
                 "install": 0.3, "preflight": 8.0}


def _set_layout(recipe: Path, sequence_parallel: bool) -> None:
    data = yaml.safe_load(recipe.read_text())
    data["accelerator"]["sequence_parallel"] = sequence_parallel
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))


def _start(project: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **ENV}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.Popen([sys.executable, "-m", "hyper_parallel.codegen", "--verbose", "generate", "--config",
                             TINY_RECIPE], cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _kill_inside(proc: subprocess.Popen, stage: str, rng: random.Random, window_s: float) -> bool:
    """Wait until ``stage`` starts (the stage before it reported done or up to date), then
    SIGKILL at a random instant within ``window_s``. False if the run ended first."""
    before = STAGES[STAGES.index(stage) - 1] if STAGES.index(stage) else None
    while before is not None:
        line = proc.stdout.readline()
        if not line:
            return False
        if line.startswith((f". {before} done", f"-- {before} up to date")):
            break
    time.sleep(rng.uniform(0, window_s))
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    return True


def _complete(bundle: Path) -> bool:
    """A bundle as install writes it: the manifest lists exactly the files present, each
    with its sha256."""
    import json

    from hyper_parallel.codegen.hash import sha256_file

    meta = json.loads((bundle / "codegen_meta.json").read_text())
    present = {p.name for p in bundle.iterdir()} - {"codegen_meta.json"}
    return present == set(meta["outputs"]) and all(sha256_file(bundle / n) == h for n, h in meta["outputs"].items())


def _leftovers(pid: int, project: Path) -> list[str]:
    """Processes of the killed run: a launch started as a fresh interpreter carries the
    run's pid (its scratch folder's name) or the project's recipe path in its command
    line; a launch forked from the run (launch/forked_module.py) carries the run's
    command line and the project as its working folder."""
    marks = (f"-{pid}-", str(project))
    found = []
    for process in psutil.process_iter(["pid", "cmdline", "cwd"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        cwd = process.info["cwd"] or ""
        if process.info["pid"] != os.getpid() and (any(mark in cmdline for mark in marks)
                                                   or Path(cwd).is_relative_to(project)):
            found.append(f"{cmdline[:200]} (in {cwd})")
    return found


def _wait_for_cleanup(pid: int, project: Path, timeout_s: float = 10.0) -> tuple[list[str], list[str]]:
    deadline = time.monotonic() + timeout_s
    while True:
        processes = _leftovers(pid, project)
        scratch = [name for name in orphaned_scratch(settle_s=0) if f"-{pid}-" in name]
        if (not processes and not scratch) or time.monotonic() > deadline:
            return processes, scratch
        time.sleep(0.25)


def test_sigkill_in_every_stage_leaves_old_or_new_and_nothing_behind(tmp_path_factory, tmp_path):
    project = copy_project(generated_tiny_project(tmp_path_factory), tmp_path / "project")
    recipe, bundle = project / TINY_RECIPE, project / BUNDLE
    original = bundle_bytes(bundle)
    rng = random.Random(2026)
    seen: dict[str, int] = {}
    missed: list[str] = []
    layout = False
    for stages in [STAGES] * TRIALS_PER_STAGE:
        layout = not layout
        _set_layout(recipe, layout)
        for stage in stages:
            for attempt in range(ATTEMPTS):  # a stage that ends before the drawn instant is run again
                proc = _start(project)
                killed = _kill_inside(proc, stage, rng, KILL_WINDOW_S[stage] / 2 ** attempt)
                if killed:
                    break
                rest = proc.stdout.read()
                proc.wait()
                missed.append(f"{stage}: rc {proc.returncode}: {rest[-300:]}")
                layout = not layout  # the run finished: everything is up to date until the recipe changes
                _set_layout(recipe, layout)
            if not killed:
                continue
            seen[stage] = seen.get(stage, 0) + 1
            assert _complete(bundle), f"killed in {stage}: the bundle is not complete"
            processes, scratch = _wait_for_cleanup(proc.pid, project)
            assert processes == [], f"killed in {stage}: processes left: {processes}"
            assert scratch == [], f"killed in {stage}: scratch left: {scratch}"
    assert sum(seen.values()) >= TRIALS_PER_STAGE * len(STAGES) and set(seen) == set(STAGES), (seen, missed)

    _set_layout(recipe, False)
    proc = cli(project, "generate", "--config", TINY_RECIPE, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert bundle_bytes(bundle) == original
    staging = [p.name for p in bundle.parent.iterdir() if p.name.startswith(".hp-bundle-")]
    temp = [p.name for p in (project / "generated").rglob("*.tmp")]
    assert staging == [] and temp == [] and orphaned_scratch() == []
