"""Tamper and drift are judged on bytes (issue: trust boundary): a bundle file edited
together with its sha256 in codegen_meta.json, or an edited stage output in the
workspace, is rebuilt or rejected — never taken as up to date, never installed."""

import json

import pytest

from hyper_parallel.codegen.hash import sha256_bytes
from tests.pipeline.pipeline_helpers import BUNDLE, ENV, MODELING_FILE, copy_project, generated_tiny_project
from tests.project_fixtures import TINY_RECIPE, bundle_bytes, cli

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORKSPACE = "generated/recipes+tiny_cpu+qwen3_moe_tiny"


@pytest.fixture
def project(tmp_path_factory, tmp_path):
    return copy_project(generated_tiny_project(tmp_path_factory), tmp_path / "project")


def _edit_modeling_file_and_its_hash(project):
    bundle = project / BUNDLE
    modeling = bundle / MODELING_FILE
    edited = modeling.read_bytes() + b"\nimport os  # planted\n"
    modeling.write_bytes(edited)
    meta = json.loads((bundle / "codegen_meta.json").read_text())
    meta["outputs"][MODELING_FILE] = sha256_bytes(edited)
    (bundle / "codegen_meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def test_an_edited_file_with_a_matching_meta_is_reinstalled_by_generate(project):
    original = bundle_bytes(project / BUNDLE)
    _edit_modeling_file_and_its_hash(project)
    proc = cli(project, "generate", "--skip-preflight", "--config", TINY_RECIPE, env=ENV)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.rstrip().endswith("stages run: install"), out  # reinstalled from the verified staged bytes
    assert bundle_bytes(project / BUNDLE) == original


def test_check_fails_on_an_edited_file_with_a_matching_meta(project):
    _edit_modeling_file_and_its_hash(project)
    proc = cli(project, "check", "--config", TINY_RECIPE, env=ENV)
    assert proc.returncode != 0
    assert f"{MODELING_FILE}: stale (differs from what generate writes now)" in proc.stderr, proc.stderr


@pytest.mark.parametrize("stage_file", ["plan.json", "frozen.json"])
def test_an_edited_plan_in_the_workspace_is_rebuilt_not_installed(project, stage_file):
    original = bundle_bytes(project / BUNDLE)
    path = project / WORKSPACE / stage_file
    text = path.read_text()
    assert '"shard(0)"' in text
    path.write_text(text.replace('"shard(0)"', '"replicate"'))  # a replicated weight, outputs still as planned
    proc = cli(project, "--verbose", "generate", "--skip-preflight", "--config", TINY_RECIPE, env=ENV)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    rebuilt = "derive" if stage_file == "plan.json" else "freeze"
    assert f". {rebuilt} done" in out, out
    assert path.read_text() == text  # rebuilt from its inputs: the edit is gone
    assert bundle_bytes(project / BUNDLE) == original
