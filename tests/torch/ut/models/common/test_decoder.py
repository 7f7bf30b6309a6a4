"""Decoder: a 2-layer model (one dense, one MoE layer) builds on meta, initializes on
CPU, runs forward; its Config round-trips through a JSON dict to the same model."""

import json

import torch

from hyper_parallel.models.common import (
    Decoder,
    FeedForward,
    GQAttention,
    MoE,
    RMSNorm,
    RoPE,
    TransformerBlock,
    set_decoder_sharding_config,
)
from hyper_parallel.protocols import config_from_dict


def _initialized(config: Decoder.Config, seed: int = 0) -> Decoder:
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_states(buffer_device="cpu")
    return model


def test_meta_build_then_cpu_init_states_and_forward(two_layer_config):
    model = _initialized(two_layer_config())
    assert isinstance(model.layers[0].feed_forward, FeedForward) and isinstance(model.layers[1].moe, MoE)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    logits = model(torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256) and torch.isfinite(logits).all()
    assert torch.equal(model.layers[0].attention_norm.weight, torch.ones(64))
    # the RoPE cache was rebuilt on CPU by init_states, equal to a directly built one
    assert torch.equal(model.rope.cos_cache, RoPE.Config(head_dim=16, max_seq_len=128, theta=1e6).build().cos_cache)


def test_same_seed_same_parameters_different_seed_different(two_layer_config):
    a, b, c = (_initialized(two_layer_config(), seed) for seed in (0, 0, 1))
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.output.weight, c.output.weight)


def test_config_round_trips_through_json_to_the_same_model(two_layer_config):
    config = two_layer_config()
    set_decoder_sharding_config(config, loss_parallel=True, enable_sp=True)
    data = json.loads(json.dumps(config.to_dict()))
    restored = Decoder.Config.from_dict(data)
    assert restored == config and config_from_dict(data) == config
    assert restored.layers[1].attention.q_proj.sharding_config == config.layers[1].attention.q_proj.sharding_config
    original, rebuilt = _initialized(config, seed=3), _initialized(restored, seed=3)
    assert str(original) == str(rebuilt)
    original_params, rebuilt_params = dict(original.named_parameters()), dict(rebuilt.named_parameters())
    assert list(original_params) == list(rebuilt_params)
    for name, param in original_params.items():
        assert torch.equal(param, rebuilt_params[name]), name


def test_a_block_needs_exactly_one_feed_forward_kind():
    import pytest

    attention = GQAttention.Config(dim=8, n_heads=2, n_kv_heads=1)
    with pytest.raises(ValueError, match="exactly one of feed_forward and moe"):
        TransformerBlock.Config(attention=attention, attention_norm=RMSNorm.Config(hidden=8),
                                ffn_norm=RMSNorm.Config(hidden=8))
