"""Verify checks the plan, not dropout: the probe's config has every dropout probability 0
(ranks draw other masks than one process), so a recipe whose model trains with dropout
(llama with attention_dropout 0.1) generates and verifies at tp2."""

import json

import pytest
import transformers

from hyper_parallel.codegen.check.probe import shrink_widths
from tests.families.family_cases import generate_tp2
from tests.project_fixtures import REPO, verify_report

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LLAMA = REPO / "tests/data/families/llama"


def test_probe_config_has_no_dropout_left():
    gpt2 = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=256, resid_pdrop=0.1,
                                   embd_pdrop=0.2, attn_pdrop=0.3, summary_first_dropout=0.4)
    dbrx = transformers.DbrxConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=256, resid_pdrop=0.1,
                                   emb_pdrop=0.1, attn_config={"attn_pdrop": 0.2, "kv_n_heads": 2})
    for config in (gpt2, dbrx):
        probe = shrink_widths(config, tp=2, ep=1, seq_len=8, where="test")
        left = {key: value for key, value in _dropouts(probe).items() if value}
        assert left == {}, (type(config).__name__, left)
        assert any(_dropouts(config).values())  # the recipe's config itself is not changed


def _dropouts(config, prefix: str = "") -> dict[str, float]:
    """Every float attribute named like a dropout probability, sub-configs included."""
    found = {}
    for key, value in vars(config).items():
        if isinstance(value, transformers.PretrainedConfig):
            found.update(_dropouts(value, f"{prefix}{key}."))
        elif ("drop" in key) and isinstance(value, float):
            found[prefix + key] = value
    return found


def test_llama_with_attention_dropout_verifies_at_tp2(tmp_path):
    def llama_with_dropout(folder):
        config = json.loads((LLAMA / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}, indent=1))

    recipe, out = generate_tp2(tmp_path / "project", "llama_dropout", llama_with_dropout)
    assert "[verify] ok: world 2 (torchrun)" in out, out[-4000:]
    verified = verify_report(tmp_path / "project", recipe)
    assert verified["max_loss_rel"] <= 1e-5 and verified["max_grad_rel"] <= 1e-4, verified
