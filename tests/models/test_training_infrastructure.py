"""HyperAutoModel applies activation checkpointing when the recipe asks; numbers don't change."""

import torch

from hyper_parallel.config import load_training_config
from hyper_parallel.models.hf.auto_model import HyperAutoModel
from tests.models.model_helpers import save_random_hf_weights, tiny_project_recipe, token_batch


def _loss_and_grads(model, batch):
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_is_applied_and_exact(tmp_path):
    recipe = tiny_project_recipe(tmp_path / "p", modeling_backend="hf")
    save_random_hf_weights(recipe.parent / "models/tiny-qwen3-moe", seed=8, recipe=recipe)
    plain = HyperAutoModel.from_pretrained(load_training_config(recipe))
    text = recipe.read_text().replace("training:\n", "training:\n  activation_checkpointing: true\n")
    recipe.write_text(text)
    checkpointed = HyperAutoModel.from_pretrained(load_training_config(recipe))

    assert checkpointed.is_activation_checkpointing and not plain.is_activation_checkpointing
    batch = token_batch(plain.config.vocab_size)
    loss_a, grads_a = _loss_and_grads(plain, batch)
    loss_b, grads_b = _loss_and_grads(checkpointed, batch)
    assert loss_a == loss_b
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-6, atol=1e-7)
