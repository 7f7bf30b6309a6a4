"""Install and clean only ever replace or remove a bundle folder, never user files."""

import errno
import logging
import subprocess
import sys

import pytest
import yaml

from hyper_parallel.codegen import bundle_folder
from hyper_parallel.codegen.bundle_folder import BundleError, write_bundle_atomic
from hyper_parallel.codegen.manager import clean_recipe, load_spec, run_pipeline
from hyper_parallel.codegen.spec.types import STAGES
from hyper_parallel.config import RecipeError
from tests.project_fixtures import TINY_RECIPE

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_install_refuses_a_folder_holding_other_files(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(BundleError, match="codegen did not write"):
        write_bundle_atomic(target, {"modeling_x.py": b"X = 1\n"}, b"{}")
    assert (target / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no staging left behind


@pytest.mark.parametrize("bundle_dir", [".", "..", "models", "models/tiny-qwen3-moe"])
def test_bundle_dir_overlapping_recipe_or_model_is_rejected(project, bundle_dir):
    recipe = project / TINY_RECIPE
    data = yaml.safe_load(recipe.read_text())
    data["model"]["codegen_artifact_dir"] = bundle_dir
    recipe.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError, match=r"model\.codegen_artifact_dir: .* would contain or overlap"):
        load_spec(recipe, project / "generated")


def test_clean_leaves_a_foreign_folder_alone(project):
    spec = load_spec(project / TINY_RECIPE, project / "generated")
    spec.bundle_dir.mkdir()
    (spec.bundle_dir / "notes.txt").write_text("keep me")
    with pytest.raises(BundleError, match="cannot remove the bundle"):
        clean_recipe(spec)
    assert (spec.bundle_dir / "notes.txt").exists()


def test_installing_over_another_recipes_bundle_warns(project, caplog):
    """Two recipes in one folder share its generated/ bundle (the seed's layout): the
    second install says whose bundle it replaced and how to keep both."""
    first = project / TINY_RECIPE
    second = first.with_name("qwen3_moe_tiny_tp1.yaml")
    data = yaml.safe_load(first.read_text())
    data["accelerator"].update(nproc_per_node=1, tp_size=1)
    second.write_text(yaml.safe_dump(data, sort_keys=False))
    until_install = STAGES[:STAGES.index("install") + 1]
    caplog.set_level(logging.INFO, logger="hyper_parallel")
    logs = []
    for recipe in (first, first, second):
        caplog.clear()
        run_pipeline(load_spec(recipe, project / "generated"), until_install)
        logs.append([record.getMessage() for record in caplog.records])
    assert not any("warning" in line for line in logs[0] + logs[1])
    warnings = [line for line in logs[2] if "warning" in line]
    assert len(warnings) == 1
    assert "held the bundle of ../qwen3_moe_tiny.yaml; it now holds ../qwen3_moe_tiny_tp1.yaml's" in warnings[0]
    assert "model.codegen_artifact_dir" in warnings[0]


def test_without_rename_exchange_the_bundle_is_replaced_in_two_renames(tmp_path, monkeypatch):
    """NFS and some overlay file systems refuse RENAME_EXCHANGE (EINVAL): the old bundle
    goes aside, the new one in, and nothing is left behind."""
    target = tmp_path / "generated"
    write_bundle_atomic(target, {"modeling_x.py": b"X = 1\n"}, b'{"n": 1}\n')
    calls = []

    def refuse(a, b):
        calls.append((a, b))
        raise bundle_folder.ExchangeUnsupported(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(bundle_folder, "_exchange", refuse)
    write_bundle_atomic(target, {"modeling_x.py": b"X = 2\n"}, b'{"n": 2}\n')
    assert len(calls) == 1
    assert (target / "modeling_x.py").read_bytes() == b"X = 2\n"
    assert (target / "codegen_meta.json").read_bytes() == b'{"n": 2}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["generated"]


def test_a_run_killed_between_the_two_renames_is_recovered_by_the_next_install(tmp_path):
    """Killed with the old bundle aside and the new one not yet in: the next install
    writes the bundle and removes the old one (its writer is dead)."""
    target = tmp_path / "generated"
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    aside = tmp_path / f".hp-bundle-generated-{proc.pid}-0badc0de-old"
    aside.mkdir()
    (aside / "modeling_x.py").write_text("X = 1\n")
    write_bundle_atomic(target, {"modeling_x.py": b"X = 2\n"}, b"{}\n")
    assert (target / "modeling_x.py").read_bytes() == b"X = 2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["generated"]
