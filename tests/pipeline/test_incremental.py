"""The doit pipeline redoes exactly what changed (issue: incremental codegen pipeline)."""

import os
import shutil
from pathlib import Path

import pytest
import yaml

from hyper_parallel.codegen.source.resolver import transformers_root
from tests.pipeline.pipeline_helpers import doit_generated_tiny_project, generated_tiny_project
from tests.project_fixtures import TINY_RECIPE, bundle_bytes, doit, tasks_ran, tasks_skipped

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ALL_STAGES = ["resolve", "derive", "freeze", "emit", "diff", "verify", "install", "preflight"]
THROUGH_INSTALL = ALL_STAGES[:-1]
# A new source or transformers reruns every stage whose input changed; derive's plan of the
# same model comes out byte-identical, so freeze is cut off (early cutoff on content).
EVERY_STAGE_BUT_FREEZE = [stage for stage in THROUGH_INSTALL if stage != "freeze"]
BUNDLE = Path("recipes/tiny_cpu/generated")


def _ok(proc):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A project where ``doit generate`` ran every stage from nothing: the run's shared one
    (tests/verify/test_verify_refuses.py starts from it too), copied so the tests here may
    run doit in it."""
    shared, out = doit_generated_tiny_project(tmp_path_factory)
    assert tasks_ran(out) == ALL_STAGES
    return shutil.copytree(shared, tmp_path_factory.mktemp("built") / "project", symlinks=True)


@pytest.fixture
def built_copy(tmp_path_factory, tmp_path):
    """A copy of the project ``built`` copies, to change: every stage up to date, as after a
    first install. Not of ``built`` itself, so the tests that change a copy are free to run
    on either pytest-xdist worker (``built`` keeps its users on one: tests/conftest.py)."""
    shared, out = doit_generated_tiny_project(tmp_path_factory)
    assert tasks_ran(out) == ALL_STAGES
    return shutil.copytree(shared, tmp_path / "copy", symlinks=True)


def test_first_generate_writes_the_bundle(built):
    names = sorted(p.name for p in (built / BUNDLE).iterdir())
    assert names == ["__init__.py", "codegen_meta.json", "modeling_Qwen3_Moe_gen_cpu.py",
                     "modeling_Qwen3_Moe_gen_cpu.py.diff"]


def test_second_generate_runs_no_stage_and_imports_no_torch(built):
    out = _ok(doit(built, "generate", f"config={TINY_RECIPE}", forbid_torch=True))
    assert tasks_ran(out) == []
    assert tasks_skipped(out) == ALL_STAGES


def test_non_codegen_fields_rerun_nothing(built):
    recipe = built / TINY_RECIPE
    original = recipe.read_text()
    data = yaml.safe_load(original)
    data["training"]["steps"] = 12345
    reordered = {key: data[key] for key in reversed(list(data))}
    try:
        recipe.write_text("# a new comment\n" + yaml.safe_dump(reordered, sort_keys=False))
        out = _ok(doit(built, "generate", f"config={TINY_RECIPE}", forbid_torch=True))
        assert tasks_ran(out) == []
    finally:
        recipe.write_text(original)


def test_generating_twice_gives_identical_bytes(tmp_path_factory):
    # Two generations from nothing in two checkouts: doit's (``built``'s source) and the
    # CLI's (the run's shared --skip-preflight project; both run the same stage functions).
    built, _ = doit_generated_tiny_project(tmp_path_factory)
    other = generated_tiny_project(tmp_path_factory)
    assert built != other
    assert bundle_bytes(other / BUNDLE) == bundle_bytes(built / BUNDLE)
    # Stage records too: install depends on them by content, so a second run that wrote
    # other bytes (a timing) would make a concurrent generate redo install.
    records = _stage_records(built)
    assert sorted(records) == ["diff.json", "emit.json", "frozen.json", "plan.json", "source.json", "verify.json"]
    assert _stage_records(other) == records


def _stage_records(project: Path) -> dict[str, bytes]:
    """The workspace's records of the stages through install (preflight ran only in ``built``)."""
    names = ("source", "plan", "frozen", "emit", "diff", "verify")
    return {path.name: path.read_bytes() for name in names for path in (project / "generated").glob(f"*/{name}.json")}


def test_copied_checkout_keeps_the_bundle_valid(built_copy):
    moved = built_copy  # the built project, copied to another folder
    out = _ok(doit(moved, "generate", f"config={TINY_RECIPE}", forbid_torch=True))
    assert tasks_ran(out) == []
    out = _ok(doit(moved, "check", f"config={TINY_RECIPE}"))
    assert "ok on 2 ranks" in out


def _set_accelerator(recipe: Path, **values) -> None:
    data = yaml.safe_load(recipe.read_text())
    data["accelerator"].update(values)
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))


def test_tp_change_reruns_every_stage_after_resolve(built_copy):
    project = built_copy
    _set_accelerator(project / TINY_RECIPE, tp_size=1, nproc_per_node=1)
    out = _ok(doit(project, "install", f"config={TINY_RECIPE}"))
    assert tasks_ran(out) == THROUGH_INSTALL[1:]
    assert tasks_skipped(out) == ["resolve"]


def _shadow_transformers(root: Path) -> Path:
    """A transformers package whose qwen3_moe modeling file differs by one comment line:
    every other file is a symlink to the installed one."""
    real = transformers_root()
    pkg = root / "transformers"
    pkg.mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name != "models":
            os.symlink(entry, pkg / entry.name)
    (pkg / "models").mkdir()
    for entry in (real / "models").iterdir():
        if entry.name != "qwen3_moe":
            os.symlink(entry, pkg / "models" / entry.name)
    qwen = pkg / "models" / "qwen3_moe"
    qwen.mkdir()
    for entry in (real / "models" / "qwen3_moe").iterdir():
        if entry.name == "modeling_qwen3_moe.py":
            (qwen / entry.name).write_text(entry.read_text() + "\n# one more line\n")
        elif entry.name != "__pycache__":
            os.symlink(entry, qwen / entry.name)
    dist_info = next(real.parent.glob("transformers-*.dist-info"))
    os.symlink(dist_info, root / dist_info.name)
    return root


def _fake_transformers_version(root: Path, version: str) -> Path:
    info = root / f"transformers-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformers\nVersion: {version}\n")
    return root


def test_modeling_source_change_reruns_everything(built_copy, tmp_path):
    project = built_copy
    shadow = _shadow_transformers(tmp_path / "shadow")
    out = _ok(doit(project, "install", f"config={TINY_RECIPE}", env={"PYTHONPATH": str(shadow)}))
    assert tasks_ran(out) == EVERY_STAGE_BUT_FREEZE
    generated = (project / BUNDLE / "modeling_Qwen3_Moe_gen_cpu.py").read_text()
    assert "# one more line" in generated  # the bundle is built from the changed source


def test_transformers_version_change_reruns_everything(built_copy, tmp_path):
    project = built_copy
    fake = _fake_transformers_version(tmp_path / "fake", "5.99.0")
    out = _ok(doit(project, "install", f"config={TINY_RECIPE}", env={"PYTHONPATH": str(fake)}))
    assert tasks_ran(out) == EVERY_STAGE_BUT_FREEZE
    assert '"transformers_version": "5.99.0"' in (project / BUNDLE / "codegen_meta.json").read_text()
