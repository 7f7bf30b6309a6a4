"""The committed bundle in the review loop (issue 14): the freshness gate fails with the
diff of every stale file and ``--fix`` rewrites it; a codegen change that emits the same
code changes no committed file."""

import json
import shutil

import pytest
import yaml

from hyper_parallel.runtime.meta import META_FILE
from hyper_parallel.codegen.check.freshness import freshness_problems
from hyper_parallel.codegen.manager import load_spec
from tests.pipeline.pipeline_helpers import BUNDLE, ENV, MODELING_FILE, copy_project, generated_tiny_project
from tests.project_fixtures import REPO, TINY_RECIPE, bundle_bytes, cli, doit

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture
def project(tmp_path_factory, tmp_path):
    """A private copy of the generated tiny project: bundle and workspace current."""
    return copy_project(generated_tiny_project(tmp_path_factory), tmp_path / "project")


def test_an_edited_bundle_and_a_changed_recipe_fail_the_gate_with_diffs_until_fix(project):
    modeling = project / BUNDLE / MODELING_FILE
    modeling.write_text(modeling.read_text() + "# edited by hand\n")
    recipe = project / TINY_RECIPE
    data = yaml.safe_load(recipe.read_text())
    data["accelerator"]["sequence_parallel"] = True
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))

    for proc in (cli(project, "check", "--config", TINY_RECIPE, env=ENV), doit(project, "check", f"config={TINY_RECIPE}",
                                                                            env=ENV)):
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, out
        assert f"{modeling}: stale (differs from what generate writes now)" in out, out
        assert f"--- {modeling} (committed)" in out and f"+++ {modeling} (generate writes)" in out, out
        assert "\n-# edited by hand\n" in out, out  # the hand edit, as the fix would remove it
        assert '+    "applied_axes": ["tp", "sp"],' in out, out  # the recipe's change, as the fix would write it
        assert f"{project / BUNDLE / META_FILE}: stale" in out, out
        assert f"fix: doit generate config={TINY_RECIPE}" in out and "check --all --fix" in out, out
        assert f"config={project / TINY_RECIPE}" not in out, out  # relative to where it runs: pasteable there

    fixed = cli(project, "check", "--config", TINY_RECIPE, "--fix", env=ENV)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "regenerated; check passed" in fixed.stdout
    assert "# edited by hand" not in modeling.read_text()
    assert freshness_problems(load_spec(project / TINY_RECIPE, project / "generated")) == []


def test_another_transformers_is_one_line_not_a_wall_of_diffs(project):
    meta_path = project / BUNDLE / META_FILE
    meta = json.loads(meta_path.read_text())
    meta["source"]["transformers_version"] = "4.0.0"
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    problems = freshness_problems(load_spec(project / TINY_RECIPE, project / "generated"))
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert problems[0].startswith(f"{project / BUNDLE}: built with transformers 4.0.0, this environment has 5.")
    assert "constraints.txt" in problems[0] and "doit generate config=" in problems[0]


def test_a_codegen_change_that_emits_the_same_code_changes_no_committed_file(project, tmp_path):
    package = tmp_path / "pkg"
    shutil.copytree(REPO / "hyper_parallel", package / "hyper_parallel",
                    ignore=shutil.ignore_patterns("__pycache__"))
    emitter = package / "hyper_parallel/codegen/emit/modeling.py"
    emitter.write_text(emitter.read_text() + "\n# a comment: the implementation hash changes, the output does not\n")
    before = bundle_bytes(project / BUNDLE)
    workspace_records = {p.name: p.read_bytes() for p in (project / "generated").glob("*/*.json")
                         if p.name != "signatures.json"}

    proc = cli(project, "generate", "--config", TINY_RECIPE, "--skip-preflight", env={"PYTHONPATH": str(package)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("stages run: emit"), proc.stdout  # no verify: early cutoff on content
    assert bundle_bytes(project / BUNDLE) == before  # codegen_meta.json included
    assert {p.name: p.read_bytes() for p in (project / "generated").glob("*/*.json")
            if p.name != "signatures.json"} == workspace_records
