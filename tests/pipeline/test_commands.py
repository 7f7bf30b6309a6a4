"""doit list / clean and the CLI's help and clean: the front doors besides generate."""

import shutil
import sys

import pytest

from tests.pipeline.pipeline_helpers import doit_generated_tiny_project
from tests.project_fixtures import TINY_RECIPE, cli, doit, make_project, run

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STAGES = ["resolve", "derive", "freeze", "emit", "diff", "verify", "install", "preflight"]


def test_doit_list_shows_every_stage_and_the_entry_points(project):
    proc = doit(project, "list", forbid_torch=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}
    assert set(STAGES) | {"generate", "check"} <= listed


def test_a_full_disk_is_one_line_before_doit_opens_its_database(tmp_path):
    """doit's sqlite state would die with a traceback on a full disk: the free space under
    the workspace is checked first (the threshold raised above what this disk has)."""
    project = make_project(tmp_path / "project")
    proc = doit(project, "list", env={"HYPER_PARALLEL_MIN_FREE_MB": str(2**40)}, forbid_torch=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"error: the pipeline workspace {project / 'generated'} is on a disk with "), lines
    assert "free some space" in lines[0]
    assert not (project / "generated").exists()


def test_doit_clean_removes_bundle_and_workspace(tmp_path_factory, tmp_path):
    # A copy of the run's shared project that doit generated (through the preflight).
    project = shutil.copytree(doit_generated_tiny_project(tmp_path_factory)[0], tmp_path / "project", symlinks=True)
    bundle, workspace = project / "recipes/tiny_cpu/generated", project / "generated/recipes+tiny_cpu+qwen3_moe_tiny"
    assert bundle.is_dir() and workspace.is_dir()
    proc = doit(project, "clean", f"config={TINY_RECIPE}", forbid_torch=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not bundle.exists() and not workspace.exists()
    assert project.joinpath("recipes", "tiny_cpu", "qwen3_moe_tiny.yaml").is_file()  # the recipe itself stays


def test_cli_clean_and_help(project):
    help_text = run([sys.executable, "-m", "hyper_parallel.codegen", "--help"], project).stdout
    for word in ("generate", "check", "clean", "--verbose", "examples:"):
        assert word in help_text
    (project / "recipes/tiny_cpu/generated").mkdir()
    (project / "recipes/tiny_cpu/generated/codegen_meta.json").write_text("{}")
    proc = cli(project, "clean", "--config", TINY_RECIPE)
    assert proc.returncode == 0, proc.stderr
    assert "removed" in proc.stdout and not (project / "recipes/tiny_cpu/generated").exists()
