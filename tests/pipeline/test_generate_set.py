"""``generate --set KEY=VALUE`` (issue 56): the recipe as overridden for this generate, in every
stage, preflight's ranks included (they load the recipe again, with the same items)."""

import json

import pytest

from tests.pipeline.pipeline_helpers import BUNDLE, ENV, copy_project, generated_tiny_project
from tests.project_fixtures import TINY_RECIPE, cli

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_generate_with_set_builds_and_preflights_the_overridden_recipe(tmp_path_factory, tmp_path):
    project = copy_project(generated_tiny_project(tmp_path_factory), tmp_path / "project")
    proc = cli(project, "generate", "--config", TINY_RECIPE, "--set", "accelerator.sequence_parallel=true", env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("install, preflight")
    meta = json.loads((project / BUNDLE / "codegen_meta.json").read_text())
    assert meta["parallel"]["sequence_parallel"] is True, meta["parallel"]


def test_a_bad_set_item_is_refused_in_one_line(tmp_path_factory, tmp_path):
    project = copy_project(generated_tiny_project(tmp_path_factory), tmp_path / "project")
    proc = cli(project, "generate", "--config", TINY_RECIPE, "--set", "accelerator.tp_sise=2", env=ENV)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "unknown key 'accelerator.tp_sise'" in proc.stderr
