"""HyperAutoModel.from_pretrained on the gen backend, in one process: the tiny recipe
(tp 1, with the grouped-experts replacement) generates its bundle inside a throwaway
project, and the model built from it equals HF on the same saved random weights."""

import sys

import pytest
import torch
import transformers

from hyper_parallel.components.modules.grouped_experts import GroupedExperts
from hyper_parallel.config import load_training_config
from hyper_parallel.models.hf import HyperAutoModel
from tests.models.model_helpers import GROUPED_EXPERTS_FACTORY, save_random_hf_weights, tiny_project_recipe, token_batch
from tests.project_fixtures import REPO

pytestmark = pytest.mark.slow

GROUPED_EXPERTS_OVERRIDE = [{"match": "*.mlp.experts", "replace_module": {"_target_": GROUPED_EXPERTS_FACTORY}}]


@pytest.fixture
def gen_recipe(tmp_path):
    return tiny_project_recipe(tmp_path / "project", codegen=True, plan_overrides=GROUPED_EXPERTS_OVERRIDE)


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(batch, labels=batch)
    out.loss.backward()
    return out.logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def test_from_pretrained_gen_builds_the_generated_class_and_matches_hf(gen_recipe, tmp_path):
    reference = save_random_hf_weights(gen_recipe.parent / "models/tiny-qwen3-moe", recipe=gen_recipe)
    repo_bundle = REPO / "recipes/tiny_cpu/generated/codegen_meta.json"
    repo_meta_before = repo_bundle.read_bytes() if repo_bundle.exists() else None

    config = load_training_config(gen_recipe)
    model = HyperAutoModel.from_pretrained(config, workspace_root=tmp_path / "project/generated")

    assert type(model).__module__.startswith("hyper_parallel_generated.")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    generated_experts = sys.modules[type(model).__module__].Qwen3MoeExperts
    for layer in model.model.layers:
        assert isinstance(layer.mlp.experts, GroupedExperts) and isinstance(layer.mlp.experts, generated_experts)
    assert (gen_recipe.parent / "generated/codegen_meta.json").is_file()  # the bundle went into the copy
    assert (repo_bundle.read_bytes() if repo_bundle.exists() else None) == repo_meta_before

    batch = token_batch(reference.config.vocab_size)
    ref_logits, ref_grads = loss_and_grads(reference, batch)
    gen_logits, gen_grads = loss_and_grads(model, batch)
    torch.testing.assert_close(gen_logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert gen_grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(gen_grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_from_pretrained_gen_reuses_the_bundle(gen_recipe, tmp_path):
    config = load_training_config(gen_recipe)
    workspace = tmp_path / "project/generated"
    HyperAutoModel.from_pretrained(config, workspace_root=workspace)
    meta = gen_recipe.parent / "generated/codegen_meta.json"
    stamp = meta.stat().st_mtime_ns
    HyperAutoModel.from_pretrained(config, workspace_root=workspace)
    assert meta.stat().st_mtime_ns == stamp


def test_from_pretrained_gen_without_weights_initializes_like_hf(gen_recipe, tmp_path):
    """No safetensors in the model folder: the generated class is initialized by HF's
    post_init in HF's module order, so a seed gives HF's weights (grouped experts too)."""
    config = load_training_config(gen_recipe)
    torch.manual_seed(3)
    model = HyperAutoModel.from_pretrained(config, workspace_root=tmp_path / "project/generated")
    hf_config = transformers.AutoConfig.from_pretrained(gen_recipe.parent / "models/tiny-qwen3-moe")
    torch.manual_seed(3)
    reference = transformers.AutoModelForCausalLM.from_config(hf_config)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
