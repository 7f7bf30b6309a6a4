"""GQAttention against HF eager attention (Qwen3-MoE: qk-norm; Qwen3.5: qk-norm with the
(1+w) norm and the sigmoid output gate), weights copied, same inputs."""

import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention

from hyper_parallel.models.common import GQAttention, Qwen3_5RMSNorm, RoPE


def _causal_mask(seq: int, dtype: torch.dtype) -> torch.Tensor:
    """HF eager's additive causal mask, [1, 1, seq, seq]."""
    return torch.full((seq, seq), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]


def _randomize(module: torch.nn.Module) -> None:
    torch.manual_seed(7)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn_like(param) * 0.2)


def _compare(ref, new, hf_config, dtype, *, rotary_dim: int, seq: int = 8) -> None:
    """Same weights, same input, same rotary tables (ours, checked against HF's in
    test_rope.py) into both."""
    _randomize(ref)
    new.load_state_dict(ref.state_dict())
    ref, new = ref.to(dtype).eval(), new.to(dtype).eval()
    torch.manual_seed(1)
    x = torch.randn(2, seq, hf_config.hidden_size, dtype=dtype)
    positions = torch.arange(seq)[None].expand(2, seq)
    rope = RoPE.Config(head_dim=rotary_dim, max_seq_len=64, theta=hf_config.rope_parameters["rope_theta"]).build()
    cos, sin = rope(x, positions)
    expected, _ = ref(x, position_embeddings=(cos, sin), attention_mask=_causal_mask(seq, dtype))
    assert torch.equal(new(x, cos, sin), expected)


def test_gqa_with_qk_norm_matches_qwen3_moe_attention(qwen3_moe_config, dtype):
    cfg = qwen3_moe_config
    ref = Qwen3MoeAttention(cfg, layer_idx=0)
    new = GQAttention.Config(dim=cfg.hidden_size, n_heads=cfg.num_attention_heads,
                             n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                             qk_norm=True, norm_eps=cfg.rms_norm_eps).build()
    _compare(ref, new, cfg, dtype, rotary_dim=cfg.head_dim)


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_gqa_with_output_gate_matches_qwen3_5_attention(dtype, kv_heads):
    cfg = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
                            rms_norm_eps=1e-6, attention_bias=False, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    ref = Qwen3_5Attention(cfg, layer_idx=3)
    new = GQAttention.Config(
        dim=64, n_heads=4, n_kv_heads=kv_heads, head_dim=16, qk_norm=True, attn_output_gate=True,
        q_norm=Qwen3_5RMSNorm.Config(hidden=16), k_norm=Qwen3_5RMSNorm.Config(hidden=16)).build()
    assert new.q_proj.weight.shape == (4 * 16 * 2, 64)  # query and gate, per head
    # Qwen3.5 rotates a quarter of each head (partial_rotary_factor 0.25)
    _compare(ref, new, cfg, dtype, rotary_dim=int(16 * cfg.rope_parameters["partial_rotary_factor"]))


def test_causality_later_tokens_do_not_change_earlier_outputs():
    new = GQAttention.Config(dim=32, n_heads=4, n_kv_heads=2, qk_norm=True).build()
    rope = RoPE.Config(head_dim=8, max_seq_len=16).build()
    torch.manual_seed(0)
    x = torch.randn(1, 6, 32)
    y = x.clone()
    y[:, 4:] = torch.randn(1, 2, 32)
    positions = torch.arange(6)[None]
    out_x, out_y = new(x, *rope(x, positions)), new(y, *rope(y, positions))
    assert torch.equal(out_x[:, :4], out_y[:, :4]) and not torch.equal(out_x[:, 4:], out_y[:, 4:])


def test_config_validates_head_grouping():
    with pytest.raises(ValueError, match="n_heads=4 is not a multiple of n_kv_heads=3"):
        GQAttention.Config(dim=32, n_heads=4, n_kv_heads=3)
