"""Each HF family (llama, qwen2, qwen3, mixtral, qwen2_moe), planned from structure and
the config's own TP hints, applied at tp 2 under torchrun, equals one process."""

import pytest

from tests.families.family_cases import (
    FAMILY_CONFIGS,
    assert_equivalent,
    planner_applies_sp,
    run_cases,
    save_random_hf_weights,
)

FAMILIES = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe")

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


@pytest.fixture(scope="module")
def family_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("families")
    with_sp = planner_applies_sp(FAMILY_CONFIGS / "llama")
    cases = []
    for family in FAMILIES:
        config_dir = FAMILY_CONFIGS / family
        weights = save_random_hf_weights(config_dir, out / f"{family}.safetensors")
        base = {"builder": "hf", "config_dir": str(config_dir), "weights": str(weights)}
        cases.append({**base, "name": f"{family}-tp2", "sequence_parallel": False})
        if with_sp:
            cases.append({**base, "name": f"{family}-tp2-sp", "sequence_parallel": True})
    return with_sp, run_cases(cases, out)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_at_tp2_equals_single_process(family, family_results):
    with_sp, results = family_results
    forms = ["tp2", "tp2-sp"] if with_sp else ["tp2"]
    for form in forms:
        for result in results[f"{family}-{form}"]:
            assert_equivalent(result)
            if form == "tp2-sp":
                assert "sp" in result["applied_axes"]
            for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
                         "model.layers.0.self_attn.o_proj.weight",
                         *(f"model.layers.0.{p}" for p in SHARDED_IN_LAYER_0[family])):
                assert name in result["sharded_params"], (family, form, name)
            for fqn, role in EXPECTED_ROLES.get(family, {}).items():
                assert result["roles"][fqn] == role, (family, fqn, result["roles"].get(fqn))
