"""On the gen path each replace_module is lowered into the generated __init__ (visible
in the .diff) and applied exactly once when the model is built."""

import pytest
import torch
import yaml

from hyper_parallel.components.modules.grouped_experts import GroupedExperts
from hyper_parallel.config import load_training_config
from hyper_parallel.models.hf.auto_model import HyperAutoModel
from tests.models import counting_replacements
from tests.models.model_helpers import save_random_hf_weights, tiny_project_recipe, token_batch

pytestmark = pytest.mark.slow

OVERRIDES = [
    {"match": "*.self_attn", "module_type": "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention",
     "replace_module": {"_target_": "tests.models.counting_replacements.counted_attention"}},
    {"match": "*.mlp.experts", "replace_module": {"_target_": "tests.models.counting_replacements.counted_experts"}},
]


def test_each_replacement_is_lowered_and_applied_exactly_once(tmp_path):
    recipe = tiny_project_recipe(tmp_path / "p", plan_overrides=OVERRIDES)
    data = yaml.safe_load(recipe.read_text())
    data["model"]["trusted_modules"] = ["tests.models.counting_replacements"]
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    hf = save_random_hf_weights(recipe.parent / "models/tiny-qwen3-moe", seed=5, recipe=recipe)
    config = load_training_config(recipe)
    workspace = tmp_path / "p" / "generated"

    HyperAutoModel.from_pretrained(config, workspace_root=workspace)  # generates the bundle
    bundle = recipe.parent / "generated"
    diff = (bundle / "modeling_Qwen3_Moe_gen_cpu.py.diff").read_text()
    apply_line = "+        hyper_parallel_runtime.hyper_apply_replacements(self, HYPER_REPLACEMENTS)"
    assert diff.count(apply_line) == 2  # base model + ForCausalLM
    assert "tests.models.counting_replacements.counted_attention" in diff

    counting_replacements.CALLS.update(attention=0, experts=0)
    model = HyperAutoModel.from_pretrained(config, workspace_root=workspace)  # reuses the bundle
    layers = hf.config.num_hidden_layers
    assert counting_replacements.CALLS == {"attention": layers, "experts": layers}
    assert all(type(layer.self_attn).__name__ == "Qwen3MoeFusedAttention" for layer in model.model.layers)
    assert all(isinstance(layer.mlp.experts, GroupedExperts) for layer in model.model.layers)

    batch = token_batch(hf.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=batch).logits, hf.eval()(input_ids=batch).logits,
                                   rtol=1e-5, atol=1e-5)
