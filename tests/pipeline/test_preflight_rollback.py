"""A generate whose preflight fails leaves no bundle the next start would import (issue 51):
install keeps what it replaces (``codegen/replaced_bundle.py``), and a preflight that fails
on the bundle install just put in swaps the earlier one back, byte for byte, or removes the
new one where there was none. The stages run in this process (``run_pipeline``, what the
CLI and doit call), with a real install and a real torchrun launch whose ranks exit before
reporting: the launch failure preflight reports for a rank that cannot start."""

import sys

import pytest
import yaml

from hyper_parallel.codegen import replaced_bundle
from hyper_parallel.codegen.check import preflight
from hyper_parallel.codegen.manager import load_spec, run_pipeline
from hyper_parallel.runtime.integrity import PreflightError
from tests.pipeline.pipeline_helpers import BUNDLE, copy_project, generated_tiny_project
from tests.project_fixtures import TINY_RECIPE, bundle_bytes

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture
def project(tmp_path_factory, tmp_path, monkeypatch):
    project = copy_project(generated_tiny_project(tmp_path_factory), tmp_path / "project")
    monkeypatch.chdir(project)  # the workspace is ./generated, as for doit
    return project


def _ranks_that_cannot_start(monkeypatch):
    """Preflight's torchrun command replaced by ranks that exit 3 without a report."""
    monkeypatch.setattr(preflight, "torchrun_command", lambda *args, **kwargs: [
        sys.executable, "-c", "import sys; sys.exit(3)"])


def _with_sequence_parallel(project):
    """The recipe changed so that generate builds and installs another bundle."""
    path = project / TINY_RECIPE
    recipe = yaml.safe_load(path.read_text())
    recipe["accelerator"]["sequence_parallel"] = True
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))


def test_a_failed_preflight_puts_the_earlier_bundle_back(project, monkeypatch):
    earlier = bundle_bytes(project / BUNDLE)
    _with_sequence_parallel(project)
    _ranks_that_cannot_start(monkeypatch)
    spec = load_spec(project / TINY_RECIPE)
    with pytest.raises(PreflightError) as failed:
        run_pipeline(spec)
    assert "the previous bundle is back" in str(failed.value), failed.value
    assert bundle_bytes(project / BUNDLE) == earlier
    assert not (spec.workspace / "replaced_bundle.json").exists()
    assert [p.name for p in (project / BUNDLE).parent.iterdir() if p.name.startswith(".hp-bundle-")] == []

    monkeypatch.undo()  # preflight's real ranks: the next generate installs the new bundle again and keeps it
    monkeypatch.chdir(project)
    assert run_pipeline(load_spec(project / TINY_RECIPE)) == ["install", "preflight"]
    installed = bundle_bytes(project / BUNDLE)
    assert installed != earlier and b'"sequence_parallel": true' in installed["codegen_meta.json"]
    assert not (spec.workspace / "replaced_bundle.json").exists()


def test_a_failed_preflight_of_a_first_install_leaves_no_bundle(project, monkeypatch):
    (project / "recipes/tiny_cpu/generated").rename(project / "earlier_bundle")
    _ranks_that_cannot_start(monkeypatch)
    with pytest.raises(PreflightError, match=r"removed .* \(there was none before\)"):
        run_pipeline(load_spec(project / TINY_RECIPE))
    assert not (project / BUNDLE).exists()


def test_a_record_of_another_bundle_restores_nothing(project, monkeypatch):
    """A bundle installed since the record was kept (another install, a hand copy) is not
    the one the record replaced: a failing preflight leaves it and says nothing of a restore."""
    spec = load_spec(project / TINY_RECIPE)
    replaced_bundle.keep_replaced_bundle(spec, b"the meta of some other bundle")
    installed = bundle_bytes(project / BUNDLE)
    _ranks_that_cannot_start(monkeypatch)
    (spec.workspace / "preflight.json").unlink(missing_ok=True)  # preflight stale: it runs
    with pytest.raises(PreflightError) as failed:
        run_pipeline(spec, ["preflight"], force=True)
    assert "back in" not in str(failed.value) and "removed" not in str(failed.value)
    assert bundle_bytes(project / BUNDLE) == installed
