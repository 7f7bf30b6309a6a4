"""The torchrun preflight of a layout without tensor parallel (cp 2, tp 1): the plan still
writes tp placements (of one rank), which the applier leaves out of each parameter's mesh;
the preflight read them against that mesh and failed every such recipe after verify had
passed (the family sweep skips the preflight, so it never showed there)."""

import pytest

from tests.pipeline.pipeline_helpers import ENV
from tests.project_fixtures import TINY_RECIPE, cli, make_project

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_a_context_parallel_only_recipe_passes_the_preflight(tmp_path):
    project = make_project(tmp_path / "project")
    tiny = (project / TINY_RECIPE).read_text()
    assert "  tp_size: 2\n" in tiny
    recipe = project / TINY_RECIPE.replace(".yaml", "_cp2.yaml")
    recipe.write_text(tiny.replace("  tp_size: 2\n", "  cp_size: 2\n"))
    proc = cli(project, "generate", "--config", str(recipe.relative_to(project)), env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("stages run: resolve, derive, freeze, emit, diff, verify, install, preflight")
