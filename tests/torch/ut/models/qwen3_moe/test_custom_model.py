"""The custom-backend Qwen3-MoE (models/common Decoder) with HF weights gives the HF
model's logits bit for bit (HF on its eager attention and eager experts paths)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hyper_parallel.distributed.sharded_load import ShardedLoadError
from hyper_parallel.distributed.weight_map import derive_weight_map, saved_layout
from hyper_parallel.models.common import Decoder, FeedForward, MoE, TransformerBlock
from hyper_parallel.models.hf.model_builder import hf_source_model, load_hf_tensors
from hyper_parallel.models.qwen3_moe.custom_model import (
    UnsupportedHFConfigError,
    build_custom_model,
    decoder_config_from_hf,
)

TINY = Path(__file__).resolve().parents[5] / "recipes/tiny_cpu/models/tiny-qwen3-moe"


def from_hf_model(hf_model):
    """A custom-backend copy of an HF model with its weights, as the custom backend builds
    one from a model folder (``build_custom_model``, then the weight map places the HF tensors)."""
    model = build_custom_model(hf_model.config)
    load_hf_tensors(model, hf_model.config, hf_model.state_dict())
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


def _per_expert(fused: dict) -> dict:
    """An HF state dict in the released checkpoints' layout: one tensor per expert."""
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
    return split


def test_per_expert_checkpoint_layout_is_stacked_like_the_fused_one():
    hf = _hf_model()
    fused = hf.state_dict()
    split = _per_expert(fused)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in split
    from_fused, from_split = build_custom_model(hf.config), build_custom_model(hf.config)
    load_hf_tensors(from_fused, hf.config, fused)
    load_hf_tensors(from_split, hf.config, split)
    for (key, a), (_, b) in zip(from_fused.state_dict().items(), from_split.state_dict().items()):
        assert torch.equal(a, b), key
    experts = from_split.layers[0].moe.experts
    assert torch.equal(experts.gate_up_proj, fused["model.layers.0.mlp.experts.gate_up_proj"])


def test_weight_map_names_and_errors_name_the_tensor(monkeypatch):
    hf = _hf_model()
    source = hf_source_model(hf.config)
    rules = derive_weight_map(build_custom_model(hf.config, device="meta"), saved_layout(source),
                              source_model=source)
    assert [r.text() for r in rules["model.layers.1.self_attn.q_norm.weight"]] == ["layers.1.attention.q_norm.weight"]
    assert [r.text() for r in rules["model.layers.0.mlp.gate.weight"]] == ["layers.0.moe.router.weight"]
    assert [r.text() for r in rules["model.layers.0.mlp.experts.2.up_proj.weight"]] == [
        f"layers.0.moe.experts.gate_up_proj[2, {hf.config.moe_intermediate_size}:"
        f"{2 * hf.config.moe_intermediate_size}]"]
    state = hf.state_dict()
    del state["model.norm.weight"]
    with pytest.raises(ShardedLoadError, match=r"HF state dict: no checkpoint tensor for norm.weight"):
        load_hf_tensors(build_custom_model(hf.config), hf.config, state)
    # A custom model with no place for an HF tensor (here: no renaming for the router)
    # is refused naming the tensor, never trained with that part left at its init.
    monkeypatch.setattr(TransformerBlock, "checkpoint_conversion",
                        tuple(pair for pair in TransformerBlock.checkpoint_conversion if pair[1] != "moe.router"))
    with pytest.raises(ShardedLoadError, match=r"model\.layers\.0\.mlp\.gate\.weight.*have no place"):
        load_hf_tensors(build_custom_model(hf.config), hf.config, hf.state_dict())


def test_unsupported_config_is_refused_by_name():
    config = AutoConfig.from_pretrained(TINY, hidden_act="gelu")
    with pytest.raises(UnsupportedHFConfigError, match="hidden_act is 'gelu'"):
        decoder_config_from_hf(config)


def test_tied_embeddings_share_one_parameter_and_load_without_lm_head():
    hf = _hf_model(tie_word_embeddings=True)
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    custom = build_custom_model(hf.config)
    assert custom.output.weight is custom.tok_embeddings.weight
    load_hf_tensors(custom, hf.config, state)
    ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        assert torch.equal(custom(ids), hf(ids).logits)


def test_meta_build_allocates_nothing():
    custom = build_custom_model(AutoConfig.from_pretrained(TINY), device="meta")
    assert isinstance(custom, Decoder) and all(p.is_meta for p in custom.parameters())
