"""Reading a recipe: a typed TrainerConfig, no side effects, strict keys, paths
relative to the YAML (DESIGN §3)."""

import os
import shutil
from pathlib import Path

import pytest

from hyper_parallel.codegen.spec.project import project_codegen_spec
from hyper_parallel.config import RecipeError, TrainerConfig, load_training_config
from tests.project_fixtures import REPO, TINY_RECIPE

TINY_MODEL = REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime: any write shows up."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.fixture
def recipes(tmp_path):
    """A folder holding the tiny recipe and its model, like recipes/tiny_cpu/."""
    folder = tmp_path / "recipes" / "tiny"
    shutil.copytree(TINY_MODEL, folder / "models" / "tiny-qwen3-moe")
    shutil.copy(REPO / TINY_RECIPE, folder / "tiny.yaml")
    return folder


def test_load_returns_trainer_config_with_absolute_yaml_path(recipes, monkeypatch):
    monkeypatch.chdir(recipes.parent)

    config = load_training_config("tiny/tiny.yaml")

    assert isinstance(config, TrainerConfig)
    assert Path(config._yaml_path).is_absolute()
    assert Path(config._yaml_path) == (recipes / "tiny.yaml").resolve()
    assert (config.accelerator.tp_size, config.accelerator.world_size, config.codegen) == (2, 2, True)
    assert config.model.pretrained_model_name_or_path == "models/tiny-qwen3-moe"
    assert config.optimizer.lr == pytest.approx(1.0e-3) and isinstance(config.optimizer.lr, float)


def test_reading_and_projecting_write_nothing(recipes, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = _listing(tmp_path)

    config = load_training_config(recipes / "tiny.yaml")
    spec = project_codegen_spec(config)

    assert _listing(tmp_path) == before
    assert not spec.bundle_dir.exists() and not spec.workspace.exists()


@pytest.mark.parametrize("text, key", [
    ("model:\n  pretrained_model_name_or_path: m\ntrainig:\n  steps: 1\n", "'trainig'"),
    ("model:\n  pretrained_model_name_or_path: m\n  torch_dtpye: float32\n", "'model.torch_dtpye'"),
    ("model:\n  pretrained_model_name_or_path: m\naccelerator:\n  tpsize: 2\n", "'accelerator.tpsize'"),
    ("model:\n  pretrained_model_name_or_path: m\nplan_overrides:\n  - match: lm_head\n    parms: {}\n",
     "'plan_overrides[0].parms'"),
])
def test_unknown_key_names_the_file_and_the_key(tmp_path, text, key):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)

    with pytest.raises(RecipeError) as info:
        load_training_config(recipe)

    message = str(info.value)
    assert str(recipe) in message and f"unknown key {key}" in message and "expected one of" in message


@pytest.mark.parametrize("text, fragments", [
    ("model:\n  pretrained_model_name_or_path: m\naccelerator:\n  tp_size: '2'\n",
     ["accelerator.tp_size", "expected int", "got str '2'"]),
    ("accelerator:\n  tp_size: 2\n", ["missing required key 'model'"]),
    ("model:\n  pretrained_model_name_or_path: m\naccelerator:\n  tp_size: 2\n  nproc_per_node: 4\n",
     ["dp_size*cp_size*tp_size*pp_size = 2", "nproc_per_node*nnodes = 4"]),
    ("model:\n  pretrained_model_name_or_path: m\naccelerator:\n  dp_size: 2\n  ep_size: 3\n"
     "  nproc_per_node: 2\n", ["accelerator.ep_size", "divisor of dp_size*cp_size = 2", "got 3"]),
])
def test_wrong_value_names_key_expected_and_actual(tmp_path, text, fragments):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)

    with pytest.raises(RecipeError) as info:
        load_training_config(recipe)

    for fragment in [str(recipe), *fragments]:
        assert fragment in str(info.value), str(info.value)


def test_paths_resolve_against_the_yaml_folder(recipes, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    nested = recipes / "variants" / "tp2.yaml"
    nested.parent.mkdir()
    nested.write_text((recipes / "tiny.yaml").read_text().replace(
        "models/tiny-qwen3-moe", "../models/tiny-qwen3-moe"))
    monkeypatch.chdir(elsewhere)  # the working directory plays no part

    for recipe, model_rel in ((recipes / "tiny.yaml", "models/tiny-qwen3-moe"),
                              (Path(os.path.relpath(nested, elsewhere)), "../models/tiny-qwen3-moe")):
        spec = project_codegen_spec(load_training_config(recipe))
        yaml_dir = Path(load_training_config(recipe)._yaml_path).parent
        assert spec.model_dir == (recipes / "models" / "tiny-qwen3-moe").resolve()
        assert spec.model_dir_rel == model_rel
        assert spec.bundle_dir == yaml_dir / "generated"
        assert spec.model_config["model_type"] == "qwen3_moe"


def test_a_recipe_larger_than_a_megabyte_is_refused_unread(tmp_path):
    recipe = tmp_path / "huge.yaml"
    recipe.write_text("model:\n  pretrained_model_name_or_path: m\n# " + "x" * (1 << 20) + "\n")
    with pytest.raises(RecipeError, match=r"huge.yaml: \d+ bytes; a recipe may have at most 1048576"):
        load_training_config(recipe)
