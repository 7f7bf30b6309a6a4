"""Each HF family (llama, qwen2, qwen3, mixtral, qwen2_moe), planned from structure and
the config's own TP hints, applied at tp 2 under torchrun, equals one process."""

import pytest

from tests.families.family_cases import FORMS, HF_FAMILIES, assert_equivalent

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# What must be tensor-parallel in each family (beyond attention, embedding and lm_head).
SHARDED_IN_LAYER_0 = {
    "llama": ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"),
    "qwen2": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "mlp.down_proj.weight"),
    "qwen3": ("mlp.gate_proj.weight", "mlp.down_proj.weight"),
    "mixtral": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
    "qwen2_moe": ("mlp.experts.gate_up_proj", "mlp.shared_expert.gate_proj.weight",
                  "mlp.shared_expert.down_proj.weight"),
}
EXPECTED_ROLES = {
    "qwen3": {"model.layers.0.self_attn.q_norm": "head_norm", "model.layers.0.self_attn.k_norm": "head_norm"},
    "mixtral": {"model.layers.0.mlp.gate": "replicate", "model.layers.0.mlp.experts": "packed_experts"},
    "qwen2_moe": {"model.layers.0.mlp.shared_expert_gate": "replicate",
                  "model.layers.0.mlp.experts": "packed_experts",
                  "model.layers.0.mlp.shared_expert.up_proj": "colwise"},
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_family_equals_single_process(family, form, family_results):
    for result in family_results[f"{family}-{form}"]:
        assert_equivalent(result, form)
        for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
                     "model.layers.0.self_attn.o_proj.weight",
                     *(f"model.layers.0.{p}" for p in SHARDED_IN_LAYER_0[family])):
            assert name in result["sharded_params"], (family, form, name)
        for fqn, role in EXPECTED_ROLES.get(family, {}).items():
            assert result["roles"][fqn] == role, (family, fqn, result["roles"].get(fqn))
