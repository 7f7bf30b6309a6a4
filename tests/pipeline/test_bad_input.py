"""Bad input that doesn't fit the bad-recipe corpus (test_bad_recipe_corpus.py): a
torchrun launch shape that contradicts a good recipe, and a bundle directory that
cannot be created. Both fail with a clear message and never touch the installed bundle.
"""

from pathlib import Path

import pytest

from tests.pipeline.pipeline_helpers import BUNDLE, ENV, copy_project, generated_tiny_project
from tests.pipeline.test_bad_recipe_corpus import (
    assert_bundle_untouched,
    assert_names_the_problem,
    installed_project,  # noqa: F401  (fixture)
)
from tests.project_fixtures import TINY_RECIPE, bundle_bytes, cli

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

TINY_DIR = Path(TINY_RECIPE).parent


def test_world_size_env_contradicting_the_recipe_is_a_clear_error(installed_project):
    project, before = installed_project

    proc = cli(project, "generate", "--config", TINY_RECIPE, "--skip-preflight",
               env={**ENV, "WORLD_SIZE": "3", "RANK": "0"})

    assert proc.returncode != 0, proc.stdout
    assert_names_the_problem(proc.stderr, ["qwen3_moe_tiny.yaml", "world size dp*cp*tp*pp = 2", "WORLD_SIZE=3"])
    assert_bundle_untouched(project, before)


@pytest.mark.parametrize("bundle_dir, expected", [
    ("blocker/generated", "blocker exists and is not a directory"),
    ("blocker", "cannot install the bundle at"),
])
def test_uncreatable_bundle_dir_is_a_clear_error(tmp_path_factory, tmp_path, bundle_dir, expected):
    # Tests run as root, which ignores permission bits: a regular file where the bundle
    # directory (or its parent) must go makes the path un-creatable instead. The good
    # recipe itself is edited (in a copy) so that only the emit/install stages rerun.
    project = copy_project(generated_tiny_project(tmp_path_factory), tmp_path / "project")
    before = bundle_bytes(project / BUNDLE)
    (project / TINY_DIR / "blocker").write_text("a file, not a folder\n")
    recipe = project / TINY_RECIPE
    recipe.write_text(recipe.read_text().replace(
        "  attn_implementation: eager\n",
        f"  attn_implementation: eager\n  codegen_artifact_dir: {bundle_dir}\n"))

    proc = cli(project, "generate", "--config", TINY_RECIPE, "--skip-preflight", env=ENV)

    assert proc.returncode != 0, proc.stdout
    assert_names_the_problem(proc.stderr, [expected, "codegen_artifact_dir"])
    assert (project / TINY_DIR / "blocker").read_text() == "a file, not a folder\n"
    assert_bundle_untouched(project, before)
