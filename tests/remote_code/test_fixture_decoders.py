"""The remote-code decoder fixtures under tests/data/remote_code/ (meta_reference,
fused_gqa, list_moe, linear_hybrid) are proper transformers remote-code models: they build from their
folder with trust_remote_code, are causal, train (finite loss, a gradient for every
parameter, AdamW lowers the loss) and survive save_pretrained / from_pretrained
unchanged. bench/family_sweep.py runs them as families; these checks keep the fixtures
themselves honest, in one process, in a few seconds."""

import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from tests.project_fixtures import REPO

DATA = REPO / "tests/data/remote_code"
# fixture -> parameter names that pin the structure its modeling file's docstring describes
FIXTURES = {
    "meta_reference": ["tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.attention.wk.weight",
                       "layers.0.attention.wv.weight", "layers.0.attention.wo.weight",
                       "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight",
                       "layers.0.feed_forward.w3.weight", "layers.0.attention_norm.weight",
                       "layers.0.ffn_norm.weight", "norm.weight", "output.weight"],
    "fused_gqa": ["decoder.embed.weight", "decoder.blocks.0.ln.bias", "decoder.blocks.0.attention.query_key_value.bias",
                  "decoder.blocks.0.attention.dense.bias", "decoder.blocks.0.mlp.dense_h_to_4h.bias",
                  "decoder.blocks.0.mlp.dense_4h_to_h.bias", "decoder.final_ln.weight"],
    "list_moe": ["backbone.token_embed.weight", "backbone.pos_embed.weight", "backbone.layers.0.attn.query.weight",
                 "backbone.layers.0.attn.out.weight", "backbone.layers.0.mlp.fc_in.weight",
                 "backbone.layers.1.moe.router.weight", "backbone.layers.1.moe.experts.3.fc_out.weight",
                 "backbone.layers.1.moe.shared_expert.fc_in.weight", "backbone.norm_out.weight", "head.weight"],
    "linear_hybrid": ["trunk.embed.weight", "trunk.blocks.0.mixer.to_qkv.weight", "trunk.blocks.0.mixer.smooth.weight",
                      "trunk.blocks.0.mixer.decay", "trunk.blocks.0.mixer.head_norm.weight",
                      "trunk.blocks.0.mixer.gate.weight", "trunk.blocks.0.mixer.merge.weight",
                      "trunk.blocks.1.mixer.wqkv.2.weight", "trunk.blocks.1.mixer.wo.weight",
                      "trunk.blocks.1.w_out.weight", "trunk.final_norm.weight", "unembed.weight"],
}
SEQ = 16


def build(name: str, seed: int = 0):
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(DATA / name, trust_remote_code=True)
    return AutoModelForCausalLM.from_config(config, trust_remote_code=True, dtype=torch.float32)


def tokens(seed: int = 1, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_is_a_remote_code_folder(name):
    folder = DATA / name
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == f"hp_{name}"
    modules = {entry.split(".")[0] for entry in config["auto_map"].values()}
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM"}
    assert {f"{module}.py" for module in modules} == {p.name for p in folder.glob("*.py")}
    modeling = next(folder.glob("modeling_*.py")).read_text()
    assert modeling.startswith('"""') and len(modeling.splitlines()) <= 170


@pytest.mark.parametrize("name", FIXTURES)
def test_builds_is_causal_and_every_parameter_gets_a_gradient(name):
    model = build(name)
    assert type(model).__module__.startswith("transformers_modules.")
    names = {n for n, _ in model.named_parameters()}
    assert set(FIXTURES[name]) <= names, sorted(set(FIXTURES[name]) - names)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ids = tokens()
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, SEQ, 256)
    assert math.isfinite(out.loss.item())
    want = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 256).float(), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, want)  # position t predicts token t + 1
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()
               or not p.grad.abs().sum() > 0]
    assert not missing, missing
    changed = ids.clone()
    changed[:, SEQ // 2:] = (changed[:, SEQ // 2:] + 1) % 256  # the future must not reach the past
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=changed).logits[:, :SEQ // 2], out.logits[:, :SEQ // 2].detach())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, build(name)(input_ids=ids).logits)  # deterministic


@pytest.mark.parametrize("name", FIXTURES)
def test_save_pretrained_round_trip_gives_identical_logits(name, tmp_path):
    model = build(name)
    model.save_pretrained(tmp_path)
    assert (tmp_path / next((DATA / name).glob("modeling_*.py")).name).is_file()  # the code travels along
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32)
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    with safe_open(tmp_path / "model.safetensors", "pt") as saved:
        keys = set(saved.keys())
    if name == "fused_gqa":  # tied: the checkpoint holds the embedding once, the head shares it
        assert "decoder.embed.weight" in keys and "lm_out.weight" not in keys
        assert loaded.lm_out.weight is loaded.decoder.embed.weight
        assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    else:
        assert keys == {n for n, _ in model.named_parameters()}
        assert loaded.get_output_embeddings().weight is not loaded.get_input_embeddings().weight


@pytest.mark.parametrize("name", FIXTURES)
def test_three_adamw_steps_lower_the_loss(name):
    model = build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    ids = tokens(batch=4)
    losses = []
    for _ in range(4):  # the loss before each of 3 steps, and after them
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        if len(losses) == 4:
            break
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert losses[1] < losses[0] and losses[3] < losses[1], losses
