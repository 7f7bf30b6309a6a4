"""``trainer dry-run`` (issue 52, item 4): every rank of the tiny recipe's world alone on this
machine on torch's fake process group, each in a process of its own."""

import json
import subprocess
import sys

import pytest

from tests.project_fixtures import REPO, TINY_RECIPE

pytestmark = [pytest.mark.slow]


def _dry_run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hyper_parallel.trainer", "dry-run", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_every_rank_of_the_tiny_recipe_runs_alone_and_reports(tmp_path):
    before = sorted(p.name for p in (REPO / "recipes/tiny_cpu").iterdir())
    proc = _dry_run("--config", TINY_RECIPE, "--rank", "all", "--steps", "2", "--json", str(tmp_path / "dry.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = json.loads((tmp_path / "dry.json").read_text())
    assert [report["rank"] for report in reports] == [0, 1] and {report["world"] for report in reports} == {2}
    for report in reports:
        assert report["steps"] == 2 and len(report["step_s"]) == 2 and report["device"] == "cpu", report
        assert report["steady_step_s"] > 0 and report["peak_memory_bytes"] > 2**20, report
        assert f"rank {report['rank']}/2 on cpu: 2 steps" in proc.stdout
    assert sorted(p.name for p in (REPO / "recipes/tiny_cpu").iterdir()) == before  # nothing saved beside it


def test_a_rank_outside_the_world_is_refused():
    proc = _dry_run("--config", TINY_RECIPE, "--rank", "2", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--rank: expected 0..1" in proc.stderr and "got '2'" in proc.stderr
