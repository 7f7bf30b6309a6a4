"""Families whose TP plan gathers inner projections (OLMo-2: q/k/v feeding whole-projection
q/k norms; Phi-3: fused qkv and gate_up, grouped-query attention) planned from structure and
their hints read by meaning, applied at tp 2 (and tp 2 with sequence parallel) under
torchrun, equal one process: loss, every gathered gradient, three AdamW steps.

Before the hints were read by meaning both crashed on the first forward (OLMo-2 in
q_norm, Phi-3 in o_proj): colwise_gather_output was read as an output head and
rowwise_split_input was unknown."""

import pytest

from tests.families.family_cases import FAMILY_CONFIGS, FORMS, assert_equivalent, run_cases, save_random_hf_weights

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FAMILIES = ("olmo2", "phi3")
EXPECTED_ROLES = {
    "olmo2": {"self_attn.q_proj": "colwise_gathered", "self_attn.k_proj": "colwise_gathered",
              "self_attn.v_proj": "colwise_gathered", "self_attn.o_proj": "rowwise_split_input",
              "self_attn.q_norm": "replicate", "self_attn.k_norm": "replicate",
              "mlp.gate_proj": "colwise", "mlp.down_proj": "rowwise"},
    "phi3": {"self_attn.qkv_proj": "colwise_gathered", "self_attn.o_proj": "rowwise_split_input",
             "mlp.gate_up_proj": "colwise_gathered", "mlp.down_proj": "rowwise_split_input"},
}


@pytest.fixture(scope="module")
def gathered_family_results(tmp_path_factory):
    """One torchrun (world 2) for every family and form; ``{"<family>-<form>": [rank 0, rank 1]}``."""
    out = tmp_path_factory.mktemp("gathered_families")
    cases = []
    for family in FAMILIES:
        config_dir = FAMILY_CONFIGS / family
        weights = save_random_hf_weights(config_dir, out / f"{family}.safetensors")
        cases += [{"name": f"{family}-{form}", "builder": "hf", "config_dir": str(config_dir),
                   "weights": str(weights), "sequence_parallel": sp} for form, sp in FORMS.items()]
    return run_cases(cases, out)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_gathered_family_equals_single_process(family, form, gathered_family_results):
    for result in gathered_family_results[f"{family}-{form}"]:
        assert_equivalent(result, form)
        for name, role in EXPECTED_ROLES[family].items():
            assert result["roles"][f"model.layers.0.{name}"] == role, (family, name, result["roles"])
        for name, role in EXPECTED_ROLES[family].items():  # the projections really are split over tp
            if role != "replicate":
                assert f"model.layers.1.{name}.weight" in result["sharded_params"], (family, name)
