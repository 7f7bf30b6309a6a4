"""The custom-backend Qwen3-MoE (models/common Decoder) with HF weights gives the HF
model's logits bit for bit (HF on its eager attention and eager experts paths)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hyper_parallel.models.common import Decoder, FeedForward, MoE
from hyper_parallel.models.qwen3_moe.custom_model import (
    UnsupportedHFConfigError,
    build_custom_model,
    decoder_config_from_hf,
)
from hyper_parallel.models.qwen3_moe.hf_state_dict import (
    HFStateDictError,
    custom_state_dict_from_hf,
    hf_key_to_custom,
    load_hf_state_dict,
)

TINY = Path(__file__).resolve().parents[5] / "recipes/tiny_cpu/models/tiny-qwen3-moe"


def from_hf_model(hf_model):
    """A custom-backend copy of an HF model with its weights, as the custom backend builds
    one from a model folder (``build_custom_model`` then ``load_hf_state_dict``)."""
    model = build_custom_model(hf_model.config)
    load_hf_state_dict(model, hf_model.state_dict())
    return model


def _hf_model(dtype=torch.float32, **overrides):
    config = AutoConfig.from_pretrained(TINY, **overrides)
    torch.manual_seed(0)
    # dtype at construction, not .to(dtype): that would also round HF's fp32 RoPE inv_freq
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager",
                                             dtype=dtype)
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_equal_hf_bit_exact(dtype):
    hf = _hf_model(dtype)
    custom = from_hf_model(hf).to(dtype).eval()
    torch.manual_seed(1)
    ids = torch.randint(0, hf.config.vocab_size, (2, 24))
    with torch.no_grad():
        assert torch.equal(custom(ids), hf(ids).logits)


def test_dense_layers_follow_hf_sparse_step_and_mlp_only_layers():
    hf = _hf_model(num_hidden_layers=3, mlp_only_layers=[0], decoder_sparse_step=1)
    config = decoder_config_from_hf(hf.config)
    assert [type(layer.moe or layer.feed_forward) for layer in config.layers] == [
        FeedForward.Config, MoE.Config, MoE.Config]
    custom = from_hf_model(hf)
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        assert torch.equal(custom(ids), hf(ids).logits)


def test_per_expert_checkpoint_layout_is_stacked_like_the_fused_one():
    hf = _hf_model()
    fused = hf.state_dict()
    split = {}
    for key, tensor in fused.items():
        prefix, _, name = key.rpartition("mlp.experts.")
        if name == "gate_up_proj":
            for e, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1))):
                split[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate
                split[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up
        elif name == "down_proj":
            for e, down in enumerate(tensor):
                split[f"{prefix}mlp.experts.{e}.down_proj.weight"] = down
        else:
            split[key] = tensor
    from_fused, from_split = custom_state_dict_from_hf(fused), custom_state_dict_from_hf(split)
    assert sorted(from_fused) == sorted(from_split)
    for key in from_fused:
        assert torch.equal(from_fused[key], from_split[key]), key


def test_key_mapping_and_errors_name_the_key():
    assert hf_key_to_custom("model.layers.3.self_attn.q_norm.weight") == "layers.3.attention.q_norm.weight"
    assert hf_key_to_custom("model.layers.0.mlp.gate.weight") == "layers.0.moe.router.weight"
    with pytest.raises(HFStateDictError, match="model.layers.0.mlp.shared_expert.weight"):
        hf_key_to_custom("model.layers.0.mlp.shared_expert.weight")
    hf = _hf_model()
    state = hf.state_dict()
    del state["model.norm.weight"]
    with pytest.raises(HFStateDictError, match=r"missing \['norm.weight'\]"):
        load_hf_state_dict(build_custom_model(hf.config), state)


def test_unsupported_config_is_refused_by_name():
    config = AutoConfig.from_pretrained(TINY, hidden_act="gelu")
    with pytest.raises(UnsupportedHFConfigError, match="hidden_act is 'gelu'"):
        decoder_config_from_hf(config)


def test_tied_embeddings_share_one_parameter_and_load_without_lm_head():
    hf = _hf_model(tie_word_embeddings=True)
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    custom = build_custom_model(hf.config)
    assert custom.output.weight is custom.tok_embeddings.weight
    load_hf_state_dict(custom, state)
    ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        assert torch.equal(custom(ids), hf(ids).logits)


def test_meta_build_allocates_nothing():
    custom = build_custom_model(AutoConfig.from_pretrained(TINY), device="meta")
    assert isinstance(custom, Decoder) and all(p.is_meta for p in custom.parameters())
