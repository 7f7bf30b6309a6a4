"""One torchrun (world 2) runs every family case of this folder; tests read its results."""

import pytest
import torch
from safetensors.torch import save_file

from tests.families.custom_decoder import build_fused_decoder
from tests.families.family_cases import (
    FAMILY_CONFIGS,
    FORMS,
    HF_FAMILIES,
    UNSEEN_FAMILY,
    run_cases,
    save_random_hf_weights,
)


def _save_custom_weights(path, seed: int = 99):
    torch.manual_seed(seed)
    model = build_fused_decoder(FAMILY_CONFIGS / UNSEEN_FAMILY)
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()}, str(path))
    return path


@pytest.fixture(scope="session")
def family_results(tmp_path_factory):
    """``{case name: [rank 0 result, rank 1 result]}``; names are ``<family>-<form>``."""
    out = tmp_path_factory.mktemp("families")
    cases = []
    for family in HF_FAMILIES:
        config_dir = FAMILY_CONFIGS / family
        weights = save_random_hf_weights(config_dir, out / f"{family}.safetensors")
        cases.append({"name": family, "builder": "hf", "config_dir": str(config_dir), "weights": str(weights)})
    config_dir = FAMILY_CONFIGS / UNSEEN_FAMILY
    cases.append({"name": UNSEEN_FAMILY, "builder": "tests.families.custom_decoder:build_fused_decoder",
                  "config_dir": str(config_dir), "weights": str(_save_custom_weights(out / "custom.safetensors"))})
    expanded = [{**case, "name": f"{case['name']}-{form}", "sequence_parallel": sp}
                for case in cases for form, sp in FORMS.items()]
    return run_cases(expanded, out)
