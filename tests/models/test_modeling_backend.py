"""Backend resolution, one test per row of the table (DESIGN §8), and the model
entry points' handling of it (warnings, from_config refusing gen)."""

import json
import shutil
import warnings

import pytest
import torch

from hyper_parallel.config.layout import Layout
from hyper_parallel.config import load_training_config
from hyper_parallel.distributed.mesh import MeshContext, ParallelDims
from hyper_parallel.models.hf import (
    BackendError,
    HyperAutoModel,
    ModelingBackend,
    custom_model_builder,
    resolve_modeling_backend,
)
from hyper_parallel.models.hf.model_builder import ModelBuildError
from hyper_parallel.models.qwen3_moe.custom_model import build_custom_model
from tests.models.model_helpers import tiny_project_recipe

QWEN3_MOE = "qwen3_moe"  # has a custom model in hyper_parallel.models.qwen3_moe
LLAMA = "llama"  # has none


def resolve(*, force_hf=False, modeling_backend=None, codegen=False, model_type=QWEN3_MOE):
    return resolve_modeling_backend(force_hf=force_hf, modeling_backend=modeling_backend, codegen=codegen,
                                    model_type=model_type)


def test_force_hf_wins_over_gen_and_warns_that_the_generated_file_is_unused():
    for asked in ({"codegen": True}, {"modeling_backend": "gen"}, {"modeling_backend": "gen", "codegen": True}):
        backend, messages = resolve(force_hf=True, **asked)
        assert backend is ModelingBackend.HF
        assert len(messages) == 1 and "generated modeling file" in messages[0] and "not used" in messages[0]


def test_force_hf_without_gen_asks_nothing_to_warn_about():
    assert resolve(force_hf=True) == (ModelingBackend.HF, [])


def test_explicit_hf_even_when_codegen_is_on():
    assert resolve(modeling_backend="hf", codegen=True) == (ModelingBackend.HF, [])


def test_explicit_custom_with_a_custom_model():
    assert resolve(modeling_backend="custom") == (ModelingBackend.CUSTOM, [])


def test_explicit_gen():
    assert resolve(modeling_backend=ModelingBackend.GEN) == (ModelingBackend.GEN, [])


def test_codegen_true_implies_gen():
    assert resolve(codegen=True) == (ModelingBackend.GEN, [])


def test_default_is_custom_when_the_model_type_has_one():
    assert resolve() == (ModelingBackend.CUSTOM, [])


def test_default_is_hf_otherwise():
    assert resolve(model_type=LLAMA) == (ModelingBackend.HF, [])


def test_custom_without_a_custom_model_warns_and_falls_back_to_hf():
    backend, messages = resolve(modeling_backend="custom", model_type=LLAMA)
    assert backend is ModelingBackend.HF
    assert len(messages) == 1 and "'llama'" in messages[0] and "falling back to HF" in messages[0]


def test_unknown_backend_is_an_error_naming_the_value():
    with pytest.raises(BackendError, match="'tpu'"):
        resolve(modeling_backend="tpu")


def test_custom_model_registry():
    assert custom_model_builder(QWEN3_MOE) is build_custom_model
    assert custom_model_builder(LLAMA) is None and custom_model_builder(None) is None


def test_from_config_refuses_gen(tmp_path):
    config = load_training_config(tiny_project_recipe(tmp_path / "project", codegen=True))
    with pytest.raises(BackendError, match=r"from_config\(\) does not support the gen backend"):
        HyperAutoModel.from_config(config)
    assert not (tmp_path / "project/recipes/tiny_cpu/generated").exists()  # nothing was generated


def test_from_config_force_hf_builds_hf_and_warns(tmp_path):
    recipe = tiny_project_recipe(tmp_path / "project", codegen=True)
    text = recipe.read_text().replace("attn_implementation: eager", "attn_implementation: eager\n  force_hf: true")
    recipe.write_text(text)
    config = load_training_config(recipe)
    assert config.model.force_hf
    with pytest.warns(UserWarning, match="generated modeling file"):
        model = HyperAutoModel.from_config(config)
    assert type(model).__module__ == "transformers.models.qwen3_moe.modeling_qwen3_moe"


def test_from_config_custom_without_a_custom_model_warns_and_builds_hf(tmp_path):
    recipe = tiny_project_recipe(tmp_path / "project", codegen=False, modeling_backend="custom")
    llama_dir = recipe.parent / "models/tiny-llama"
    shutil.copytree(recipe.parent / "models/tiny-qwen3-moe", llama_dir)
    config_json = json.loads((llama_dir / "config.json").read_text())
    config_json.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (llama_dir / "config.json").write_text(json.dumps(config_json))
    recipe.write_text(recipe.read_text().replace("models/tiny-qwen3-moe", "models/tiny-llama"))
    with pytest.warns(UserWarning, match="no custom model for model_type 'llama'"):
        model = HyperAutoModel.from_config(load_training_config(recipe))
    assert type(model).__name__ == "LlamaForCausalLM"


def test_from_config_default_backend_is_custom_for_qwen3_moe(tmp_path):
    config = load_training_config(tiny_project_recipe(tmp_path / "project", codegen=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on this path
        model = HyperAutoModel.from_config(config)
    assert type(model).__module__ == "hyper_parallel.models.common.decoder"
    logits = model(torch.zeros(1, 4, dtype=torch.long))
    assert logits.shape == (1, 4, 256)


def test_a_mesh_of_other_sizes_than_the_recipe_is_refused(tmp_path):
    config = load_training_config(tiny_project_recipe(tmp_path / "project", codegen=False))  # tp 1
    with pytest.raises(ModelBuildError, match=r"layout \(dp=1 cp=1 tp=1 ep=1 pp=1 .*\) differs from the mesh context's \(dp=1 cp=1 tp=2 .*\) in tp;"):
        HyperAutoModel.from_config(config, mesh_context=MeshContext(device_mesh=None, layout=Layout(ParallelDims(tp=2))))
