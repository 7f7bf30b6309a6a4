"""Rank coordination on the training path (DESIGN §4): a non-zero rank waiting for
rank 0's bundle ends within its timeout, fails fast with rank 0's error, or returns
once rank 0 has installed a bundle with its signature. Never a hang."""

import json
import subprocess
import sys
import time

import pytest

from hyper_parallel.runtime.meta import META_FILE
from hyper_parallel.codegen.hash import implementation_sha256
from hyper_parallel.codegen.manager import CodegenWaitError, ensure_codegen_artifact
from hyper_parallel.config import load_training_config
from tests.project_fixtures import REPO, TINY_RECIPE, make_project

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SLACK_S = 2.0  # scheduling slack on a busy 2-core machine
# A recipe that fails in the derive stage: the override matches no module (never a silent no-op).
BROKEN_OVERRIDE = """
plan_overrides:
  - match: model.layers.0.no_such_module
    params:
      weight: {tp: replicate}
"""
RANK0_SCRIPT = """
import sys
from hyper_parallel.codegen.manager import ensure_codegen_artifact
from hyper_parallel.config import load_training_config
ensure_codegen_artifact(load_training_config(sys.argv[1]), rank=0, workspace_root=sys.argv[2])
"""


def _recipe(project, broken: bool = False):
    path = project / TINY_RECIPE
    if broken:
        path.write_text(path.read_text() + BROKEN_OVERRIDE)
    return load_training_config(path)


def _wait_as_rank1(project, timeout_s: float):
    return ensure_codegen_artifact(_recipe(project), rank=1, timeout_s=timeout_s, poll_s=0.05,
                                   workspace_root=project / "generated")


def test_rank1_times_out_naming_what_it_waited_for(tmp_path):
    project = make_project(tmp_path / "project")
    start = time.monotonic()
    with pytest.raises(CodegenWaitError) as err:
        _wait_as_rank1(project, timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert 1.0 <= elapsed <= 1.0 + SLACK_S, elapsed
    message = str(err.value)
    assert str(project / "recipes/tiny_cpu/generated" / META_FILE) in message, message
    assert "with signature" in message and "found: no bundle" in message, message


def test_rank1_fails_fast_with_rank0s_error(tmp_path):
    project = make_project(tmp_path / "project")
    config = _recipe(project, broken=True)
    with pytest.raises(Exception) as rank0_err:
        ensure_codegen_artifact(config, rank=0, workspace_root=project / "generated")
    assert "no_such_module" in str(rank0_err.value)

    start = time.monotonic()
    with pytest.raises(CodegenWaitError) as err:
        ensure_codegen_artifact(config, rank=1, timeout_s=60.0, poll_s=0.05,
                                workspace_root=project / "generated")
    assert time.monotonic() - start < SLACK_S  # rank 0's record, not the 60 s timeout, ended the wait
    message = str(err.value)
    assert message.startswith("rank 0 failed to generate"), message
    assert str(rank0_err.value) in message, message


def test_rank1_returns_when_rank0_installs_the_bundle(tmp_path):
    project = make_project(tmp_path / "project")
    workspace = project / "generated"
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0_SCRIPT, str(project / TINY_RECIPE), str(workspace)],
                             cwd=project, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                                               "OMP_NUM_THREADS": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Like a freshly started rank, hash the package's code now, not when an earlier test
    # of this process did (the code hash is cached per process and part of the signature).
    implementation_sha256.cache_clear()
    assert rank0.poll() is None  # rank 1 starts waiting while rank 0 still generates
    try:
        spec = _wait_as_rank1(project, timeout_s=120.0)  # started before rank 0 could have finished
    finally:
        _, stderr = rank0.communicate(timeout=120)
    assert rank0.returncode == 0, stderr[-3000:]
    meta = json.loads((spec.bundle_dir / META_FILE).read_text())
    assert spec.bundle_dir == project / "recipes/tiny_cpu/generated"
    assert (spec.bundle_dir / meta["modeling_file"]).is_file()
