"""Verify checks the plan, not dropout: the probe's config has every dropout probability 0
(ranks draw other masks than one process), so a recipe whose model trains with dropout
(llama with attention_dropout 0.1) generates and verifies at tp2."""

import json

import transformers
import yaml

from hyper_parallel.codegen.check.probe import shrink_widths
from tests.project_fixtures import REPO, cli

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
    project = tmp_path / "project"
    model_dir = project / "recipes/llama_dropout/model"
    model_dir.mkdir(parents=True)
    (project / "dodo.py").write_bytes((REPO / "dodo.py").read_bytes())
    config = json.loads((LLAMA / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}, indent=1))
    recipe = project / "recipes/llama_dropout/recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"pretrained_model_name_or_path": "model", "torch_dtype": "float32", "attn_implementation": "eager"},
        "accelerator": {"device_type": "cpu", "nproc_per_node": 2, "nnodes": 1, "tp_size": 2},
        "codegen": True,
        "training": {"steps": 1, "global_batch_size": 2, "micro_batch_size": 1, "seq_len": 16, "seed": 0},
        "optimizer": {"name": "adamw", "lr": 1.0e-3}}, sort_keys=False))
    proc = cli(project, "--verbose", "generate", "--skip-preflight", "--config", str(recipe))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[verify] ok: world 2 (torchrun)" in out, out[-4000:]
    verified = json.loads((recipe.parent / "generated/codegen_meta.json").read_text())["verified"]
    assert verified["max_loss_rel"] <= 1e-5 and verified["max_grad_rel"] <= 1e-4, verified
