"""Two generations of the same recipe started together in the same project both
succeed and leave one valid bundle (DESIGN §4: atomic install, sqlite3 doit DB).

Each pair races from a fresh project through every stage: both processes write the
same workspace files and swap the same bundle in. Stage outputs are written through
per-process temp files and ``os.replace``, the bundle through a staging dir and an
atomic rename/exchange, and doit's sqlite3 DB takes concurrent writers, so neither run
may fail and the result must be the bundle a single run gives.

One round each (the doit pair alone, with its two torchrun preflights, takes about a
minute on 2 cores). Both pairs must leave the bytes one serial generate writes (the
serial bundle was verified and is integrity-checked here, so no ``doit check`` reruns
verify and the preflight on a copy of it). The bundle signature covers
the package's own sources, so editing hyper_parallel/ while this runs makes the bundle
stale and the signature checks fail, as they should.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_parallel.runtime.integrity import preflight_integrity_check
from hyper_parallel.codegen.hash import implementation_sha256
from hyper_parallel.codegen.manager import load_spec
from hyper_parallel.codegen.spec.project import signature_from_spec
from tests.pipeline.pipeline_helpers import BUNDLE, ENV, generated_tiny_project
from tests.project_fixtures import TINY_RECIPE, bundle_bytes, doit, make_project, run, tasks_ran

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

DOIT_GENERATE = [sys.executable, "-m", "doit", "generate", f"config={TINY_RECIPE}"]
CLI_GENERATE = [sys.executable, "-m", "hyper_parallel.codegen", "generate", "--config", TINY_RECIPE,
                "--skip-preflight"]


def _start_together(cmd: list[str], project: Path, copies: int = 2) -> list[subprocess.CompletedProcess]:
    """Start ``copies`` processes of ``cmd`` back to back, then wait for all of them."""
    procs = [subprocess.Popen(cmd, cwd=project, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(copies)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **ENV}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _assert_both_succeeded(results: list[subprocess.CompletedProcess]) -> None:
    for proc in results:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def _assert_one_clean_valid_bundle(project: Path) -> None:
    # The implementation hash is cached per process; recompute it, as the generating
    # subprocesses did, in case the package's sources changed since this process cached it.
    implementation_sha256.cache_clear()
    spec = load_spec(project / TINY_RECIPE, project / "generated")
    report = preflight_integrity_check(spec.bundle_dir, expected_signature=signature_from_spec(spec))
    assert report["plan_entries"] > 0
    strays = [p.name for p in (project / BUNDLE).parent.iterdir() if p.name.startswith(".hp-bundle-")]
    strays += [p.name for p in (project / "generated").rglob("*.tmp")]
    assert strays == []


def test_two_doit_generate_at_once(tmp_path, tmp_path_factory):
    project = make_project(tmp_path / "project")

    results = _start_together(DOIT_GENERATE, project)

    _assert_both_succeeded(results)
    _assert_one_clean_valid_bundle(project)
    serial = generated_tiny_project(tmp_path_factory)
    assert bundle_bytes(project / BUNDLE) == bundle_bytes(serial / BUNDLE)
    again = doit(project, "generate", f"config={TINY_RECIPE}", env=ENV)
    assert again.returncode == 0 and tasks_ran(again.stdout) == [], again.stdout + again.stderr


def test_two_cli_generate_at_once(tmp_path, tmp_path_factory):
    project = make_project(tmp_path / "project")

    results = _start_together(CLI_GENERATE, project)

    _assert_both_succeeded(results)
    _assert_one_clean_valid_bundle(project)
    serial = generated_tiny_project(tmp_path_factory)
    assert bundle_bytes(project / BUNDLE) == bundle_bytes(serial / BUNDLE)
    again = run(CLI_GENERATE, project, env=ENV)
    assert again.returncode == 0 and "up to date" in again.stdout, again.stdout + again.stderr
