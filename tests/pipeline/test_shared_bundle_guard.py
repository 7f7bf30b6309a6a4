"""A copied recipe does not silently rewrite the committed bundle of the recipe it was copied
from (issue 56): recipes in one folder share one bundle, but replacing a bundle another
recipe made and git tracks is refused before any stage runs, with the fix."""

import subprocess

import pytest

from hyper_parallel.codegen.bundle_folder import REPLACE_ENV, BundleError, check_not_anothers_tracked_bundle
from tests.pipeline.pipeline_helpers import BUNDLE, ENV, copy_project, generated_tiny_project
from tests.project_fixtures import TINY_RECIPE, bundle_bytes, cli

pytestmark = [pytest.mark.slow]


@pytest.fixture
def committed(tmp_path_factory, tmp_path):
    """A copy of the generated tiny project in a git repository, its bundle committed."""
    project = copy_project(generated_tiny_project(tmp_path_factory), tmp_path / "project")
    for command in (["git", "init", "-q"], ["git", "add", "recipes"],
                    ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "bundle"]):
        subprocess.run(command, cwd=project, check=True, capture_output=True)
    return project


def test_a_copied_recipe_is_refused_before_it_replaces_a_tracked_bundle(committed):
    copy = committed / "recipes/tiny_cpu/my_copy.yaml"
    copy.write_text((committed / TINY_RECIPE).read_text())
    before = bundle_bytes(committed / BUNDLE)
    proc = cli(committed, "generate", "--config", "recipes/tiny_cpu/my_copy.yaml", env=ENV)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "holds the bundle of ../qwen3_moe_tiny.yaml, which git tracks" in proc.stderr
    assert "model.codegen_artifact_dir" in proc.stderr and REPLACE_ENV in proc.stderr
    assert bundle_bytes(committed / BUNDLE) == before
    assert not (committed / "generated/recipes+tiny_cpu+my_copy").exists()  # no stage ran


def test_the_same_recipe_an_untracked_bundle_or_the_env_may_replace(committed, monkeypatch):
    folder = committed / BUNDLE
    check_not_anothers_tracked_bundle(folder, "../qwen3_moe_tiny.yaml", "fix")  # its own recipe
    with pytest.raises(BundleError, match="which git tracks"):
        check_not_anothers_tracked_bundle(folder, "../other.yaml", "fix")
    monkeypatch.setenv(REPLACE_ENV, "1")
    check_not_anothers_tracked_bundle(folder, "../other.yaml", "fix")
    monkeypatch.delenv(REPLACE_ENV)
    subprocess.run(["git", "rm", "-rq", "--cached", "recipes"], cwd=committed, check=True)
    check_not_anothers_tracked_bundle(folder, "../other.yaml", "fix")  # untracked: the shared folder's design
