"""Verify steps the bundle's model with the trainer's own step (issue 53): the same
``TrainStep`` (runtime/train_step.py) and AdamW (distributed/optimizer.py) the trainer runs.
A deliberate change to that step (every accumulated gradient doubled, in every process of
the run, through a ``sitecustomize`` on PYTHONPATH) makes verify fail on the gradients; the
same generate without the change passes."""

import pytest

from tests.project_fixtures import REPO, TINY_RECIPE, cli

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CHANGED_STEP = REPO / "tests/verify/changed_step"


@pytest.mark.parametrize("changed", [True, False], ids=["changed-step", "trainers-step"])
def test_verify_fails_when_the_trainers_step_changes(project, changed):
    env = {"PYTHONPATH": f"{CHANGED_STEP}:{REPO}", **({"HP_TEST_CHANGED_STEP": "1"} if changed else {})}
    proc = cli(project, "generate", "--config", str(project / TINY_RECIPE), "--skip-preflight", env=env,
               timeout=600)
    out = proc.stdout + proc.stderr
    if changed:
        assert proc.returncode != 0, out
        assert "verify failed" in out and "gradient of model." in out and "differs from one device's" in out, out
    else:
        assert proc.returncode == 0, out
        assert "stages run: " in out and "verify, install" in out, out
