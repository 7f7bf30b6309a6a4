"""Where the recipe's model comes from and what it loads (issue 28): a folder's weights in
every form ``from_pretrained`` reads (safetensors, ``pytorch_model.bin`` whole or sharded),
a Hub id from the local cache with no network, and one line, before any rank starts, for a
folder without weights unless the recipe says ``model.init: random``."""

import json
import subprocess
import sys

import pytest
import torch
import transformers
import yaml
from huggingface_hub import constants

from hyper_parallel.codegen.spec.project import project_codegen_spec
from hyper_parallel.config import load_training_config
from hyper_parallel.config.model_files import checkpoint_files, model_location
from hyper_parallel.models.hf import model_builder as mb
from hyper_parallel.runtime.recipe import Recipe
from tests.project_fixtures import TINY_RECIPE

TINY_MODEL = "models/tiny-qwen3-moe"


def _recipe(project, **model) -> "Path":  # noqa: F821 (a pathlib.Path)
    recipe = project / TINY_RECIPE
    data = yaml.safe_load(recipe.read_text())
    data["model"].update(model)
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    return recipe


def _reference(model_dir, seed: int = 3) -> dict[str, torch.Tensor]:
    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").state_dict()


def _built_state(recipe) -> dict[str, torch.Tensor]:
    """The model as the trainer's builder makes it (hf backend, one process)."""
    config = load_training_config(recipe)
    model = mb.build_hf_model(Recipe.load(config).hf_config, config, with_weights=mb.weights_to_load(config))
    return model.state_dict()


def _assert_loaded(recipe, reference) -> None:
    built = _built_state(recipe)
    for name, tensor in reference.items():
        assert torch.equal(built[name], tensor), name


@pytest.mark.parametrize("form", ["bin", "sharded_bin"])
def test_pytorch_model_bin_folders_load(project, form):
    model_dir = project / "recipes/tiny_cpu" / TINY_MODEL
    state = _reference(model_dir)
    if form == "bin":
        torch.save(state, model_dir / "pytorch_model.bin")
    else:  # two shards and their index, as transformers wrote them before safetensors
        names = sorted(state)
        files = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
        for file, keys in files.items():
            torch.save({k: state[k] for k in keys}, model_dir / file)
        (model_dir / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: file for file, keys in files.items() for k in keys}}))
    assert [p.suffix for p in checkpoint_files(model_dir)] == [".bin"] * (1 if form == "bin" else 2)
    recipe = _recipe(project, init="pretrained")
    _assert_loaded(recipe, state)
    loaded = mb.load_checkpoint_state_dict(model_dir)  # the custom backend's reader
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)


def test_a_hub_id_resolves_from_the_local_cache_offline(project, tmp_path, monkeypatch):
    """The cache laid out as huggingface_hub lays it out (models--org--name/snapshots/<rev>,
    refs/main); HF_HUB_OFFLINE on, so any network use would fail."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--tiny-qwen3-moe" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    source = project / "recipes/tiny_cpu" / TINY_MODEL
    (snapshot / "config.json").write_text((source / "config.json").read_text())
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(source))
    model.save_pretrained(snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    recipe = _recipe(project, pretrained_model_name_or_path="tiny-org/tiny-qwen3-moe", init="pretrained")
    config = load_training_config(recipe)
    assert model_location(config).folder == snapshot.resolve()
    assert project_codegen_spec(config).model_dir_rel == "hf://tiny-org/tiny-qwen3-moe"  # no machine's cache path
    _assert_loaded(recipe, model.state_dict())


def _trainer(recipe) -> subprocess.CompletedProcess:
    """The trainer's front door, as a user types it (no torchrun: the recipe is refused first)."""
    return subprocess.run([sys.executable, "-m", "hyper_parallel.trainer", "--config", str(recipe)],
                          capture_output=True, text=True, timeout=300)


def test_no_weights_is_one_line_before_any_rank_starts_unless_init_is_random(project):
    recipe = _recipe(project, init="pretrained")
    proc = _trainer(recipe)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    for part in (str(recipe), "model.init is pretrained", str(project / "recipes/tiny_cpu" / TINY_MODEL),
                 "*.safetensors", "pytorch_model*.bin", "model.init: random"):
        assert part in proc.stderr, (part, proc.stderr)
    proc = _trainer(_recipe(project, init="random"))  # the same folder, said to start fresh: on to torchrun
    assert proc.returncode == 2 and "the trainer runs under torchrun" in proc.stderr, proc.stderr


def test_a_hub_id_not_in_the_cache_says_how_to_download_it(project, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    recipe = _recipe(project, pretrained_model_name_or_path="nobody/no-such-model")
    with pytest.raises(mb.ModelBuildError, match=r"no model nobody/no-such-model in the local Hugging Face cache .*"
                                                 r"hf download nobody/no-such-model"):
        mb.recipe_model_dir(load_training_config(recipe))
