"""SIGKILL during checkpoint saves (issue 16): each trial starts the tiny recipe's
training (a checkpoint after every step), waits until a save's ``.tmp-`` folder appears,
and SIGKILLs torchrun and every rank at a random instant after it. After every kill each
``step_<N>`` folder is complete (has its marker); the next trial's start removes the
partial folders, resumes from the newest complete checkpoint and says so. A last run
trains two steps past the newest checkpoint, and they equal an uninterrupted run's
exactly."""

import json
import math
import os
import random
import signal
import subprocess
import time

import psutil
import pytest
import yaml

from hyper_parallel.codegen.check.forked_torchrun import torchrun_command
from hyper_parallel.trainer.checkpoint import MARKER, scan
from tests.launch import assert_ran, torchrun
from tests.pipeline.pipeline_helpers import copy_project, generated_tiny_project
from tests.project_fixtures import TINY_RECIPE

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

TRIALS = 4  # each a kill at a random instant after a save began; the suite's 20-minute budget bounds the count
STEPS = 40  # more than the trials reach: every trial ends in a kill
QWEN3_MOE_MODELING = "transformers.models.qwen3_moe.modeling_qwen3_moe"
KILL_WINDOW_S = 0.2  # about one save of the tiny model on 2 busy cores: most kills land inside one


def _command(recipe, metrics) -> list[str]:
    return torchrun_command(2, "hyper_parallel.trainer", ["--config", str(recipe), "--metrics", str(metrics)],
                            preload=["transformers", "hyper_parallel.trainer.__main__", QWEN3_MOE_MODELING])


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every rank at once, as a lost host would end them."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for member in family:
        try:
            member.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs(family, timeout=10)


def _kill_during_a_save(project, recipe, root, log, rng: random.Random) -> bool:
    """Start training, SIGKILL it at a random instant after its first, second or third
    save began (the first save after a start is the slowest). False if the run finished
    first."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    with open(log, "w") as out:
        proc = subprocess.Popen(_command(recipe, log.with_suffix(".json")), cwd=project, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
        # A save this run began (the last kill's partial folders are there until its start
        # removes them).
        seen = set(root.iterdir()) if root.is_dir() else set()
        saves = rng.randint(1, 3)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            new = {p for p in root.iterdir() if ".tmp-" in p.name} - seen if root.is_dir() else set()
            saves -= len(new)
            seen |= new
            if saves <= 0:
                time.sleep(rng.uniform(0, KILL_WINDOW_S))
                _kill_tree(proc)
                return True
            time.sleep(0.002)
        _kill_tree(proc)
        return False


def test_sigkill_during_saves_leaves_the_previous_checkpoint_loadable(tmp_path_factory, tmp_path):
    # The suite's generated tiny project (training is no codegen input): no trial generates.
    project = copy_project(generated_tiny_project(tmp_path_factory), tmp_path / "project")
    recipe = project / TINY_RECIPE
    data = yaml.safe_load(recipe.read_text())
    data["training"].update(steps=STEPS, global_batch_size=4, micro_batch_size=2, seq_len=12,
                            checkpoint={"dir": "checkpoints", "every_steps": 1, "keep_last": 2})
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    root = recipe.parent / "checkpoints"
    rng = random.Random(16)
    killed_with_partial = 0
    newest = None
    for trial in range(TRIALS):
        log = tmp_path / f"trial{trial}.txt"
        assert _kill_during_a_save(project, recipe, root, log, rng), log.read_text()[-3000:]
        text = log.read_text()
        if newest is not None:  # this start resumed from what the last kill left
            assert f"resumed from checkpoint {newest}" in text, text[-3000:]
        complete, partial = scan(root)
        killed_with_partial += bool(partial)
        for _, folder in complete:
            assert json.loads((folder / MARKER).read_text())["step"] == int(folder.name.split("_")[1])
        assert not [p for p in partial if "." not in p.name], partial  # no step_<N> without its marker
        newest = complete[-1][1] if complete else None
    assert killed_with_partial >= 1  # at least one kill landed inside a save (others just after one)
    assert newest is not None and int(newest.name.split("_")[1]) >= 2  # and training went on between them

    # Two steps past the newest checkpoint: batches depend on the step index alone.
    data["training"]["steps"] = int(newest.name.split("_")[1]) + 2
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))

    proc = torchrun(["-m", "hyper_parallel.trainer", "--config", str(recipe), "--metrics",
                     str(tmp_path / "resumed.json")], project, nproc=2, preload=(QWEN3_MOE_MODELING,))
    assert_ran(proc)
    assert not scan(root)[1]  # partial folders removed
    resumed = json.loads((tmp_path / "resumed.json").read_text())

    data["training"]["checkpoint"] = {"dir": "reference"}
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = torchrun(["-m", "hyper_parallel.trainer", "--config", str(recipe), "--metrics",
                     str(tmp_path / "whole.json")], project, nproc=2, preload=(QWEN3_MOE_MODELING,))
    assert_ran(proc)
    whole = {r["step"]: r for r in json.loads((tmp_path / "whole.json").read_text())}
    assert [r["step"] for r in resumed] == [data["training"]["steps"] - 1, data["training"]["steps"]]
    for record in resumed:
        assert math.isclose(record["loss"], whole[record["step"]]["loss"], rel_tol=1e-7), (resumed, whole)
        assert math.isclose(record["grad_norm"], whole[record["step"]]["grad_norm"], rel_tol=1e-7)
