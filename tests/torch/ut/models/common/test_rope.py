import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding
from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb as hf_apply_rotary

from hyper_parallel.models.common import RoPE, apply_rotary_pos_emb


def _rope_config(hf_config) -> RoPE.Config:
    return RoPE.Config(head_dim=hf_config.head_dim, max_seq_len=hf_config.max_position_embeddings,
                       theta=hf_config.rope_parameters["rope_theta"])


def test_init_states_rebuilds_cos_sin_cache_equal_to_hf(qwen3_moe_config):
    with torch.device("meta"):
        rope = _rope_config(qwen3_moe_config).build()
    assert rope.cos_cache.is_meta
    rope.init_states(buffer_device="cpu")
    hf = Qwen3MoeRotaryEmbedding(qwen3_moe_config)
    positions = torch.arange(qwen3_moe_config.max_position_embeddings)[None]
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions)
    assert rope.cos_cache.device.type == "cpu"
    assert torch.equal(rope.cos_cache, cos[0]) and torch.equal(rope.sin_cache, sin[0])
    assert torch.equal(rope.inv_freq, hf.inv_freq)


def test_forward_lookup_equals_hf_for_any_positions(qwen3_moe_config, dtype):
    rope = _rope_config(qwen3_moe_config).build()
    hf = Qwen3MoeRotaryEmbedding(qwen3_moe_config)
    x = torch.zeros(1, dtype=dtype)
    for positions in (torch.arange(16)[None], torch.tensor([[5, 0, 255, 17], [3, 3, 100, 1]])):
        for ours, ref in zip(rope(x, positions), hf(x, positions)):
            assert ours.dtype == dtype and torch.equal(ours, ref)


def test_init_states_repairs_a_clobbered_cache(qwen3_moe_config):
    rope = _rope_config(qwen3_moe_config).build()
    expected = rope.cos_cache.clone()
    rope.cos_cache.fill_(7.0)
    rope.init_states()
    assert torch.equal(rope.cos_cache, expected)
    assert "cos_cache" not in rope.state_dict()  # derived, never checkpointed


def test_apply_rotary_pos_emb_equals_hf(qwen3_moe_config, dtype):
    rope = _rope_config(qwen3_moe_config).build()
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 8, 16, dtype=dtype), torch.randn(2, 2, 8, 16, dtype=dtype)
    cos, sin = rope(q, torch.arange(8)[None].expand(2, 8))
    for ours, ref in zip(apply_rotary_pos_emb(q, k, cos, sin), hf_apply_rotary(q, k, cos, sin)):
        assert torch.equal(ours, ref)


def test_partial_rotary_equals_hf_qwen3_5(dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb as hf_qwen3_5_rotary

    rope = RoPE.Config(head_dim=4, max_seq_len=32).build()  # a quarter of head_dim 16 rotates
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 8, 16, dtype=dtype), torch.randn(2, 2, 8, 16, dtype=dtype)
    cos, sin = rope(q, torch.arange(8)[None].expand(2, 8))
    ours, ref = apply_rotary_pos_emb(q, k, cos, sin), hf_qwen3_5_rotary(q, k, cos, sin)
    for a, b, original in zip(ours, ref, (q, k)):
        assert torch.equal(a, b) and torch.equal(a[..., 4:], original[..., 4:])
