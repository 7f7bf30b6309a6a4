"""Shared fixtures: the tiny Qwen3-MoE config (recipes/tiny_cpu) with HF's eager
attention and eager experts, the reference paths these components mirror op for op."""

from pathlib import Path

import pytest
from transformers import AutoConfig

from hyper_parallel.models.common import (
    Decoder,
    DecoderBlock,
    Embedding,
    FeedForward,
    GQAttention,
    Linear,
    MoE,
    RMSNorm,
    RoPE,
    TransformerBlock,
)

TINY_QWEN3_MOE = Path(__file__).resolve().parents[5] / "recipes/tiny_cpu/models/tiny-qwen3-moe"


@pytest.fixture
def qwen3_moe_config():
    config = AutoConfig.from_pretrained(TINY_QWEN3_MOE)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


@pytest.fixture(params=["float32", "bfloat16"])
def dtype(request):
    import torch

    return getattr(torch, request.param)


@pytest.fixture
def two_layer_config():
    """A factory: each call gives a fresh 2-layer ``Decoder.Config``."""
    return _two_layer_config


def _two_layer_config() -> Decoder.Config:
    """Dense layer 0, MoE layer 1; hidden 64, 4 heads / 2 kv heads, vocab 256."""
    dim = 64

    def block(ffn: dict) -> TransformerBlock.Config:
        return DecoderBlock.Config(
            attention=GQAttention.Config(dim=dim, n_heads=4, n_kv_heads=2, qk_norm=True),
            attention_norm=RMSNorm.Config(hidden=dim), ffn_norm=RMSNorm.Config(hidden=dim), **ffn)

    return Decoder.Config(
        tok_embeddings=Embedding.Config(num_embeddings=256, embedding_dim=dim),
        rope=RoPE.Config(head_dim=16, max_seq_len=128, theta=1e6),
        layers=[block({"feed_forward": FeedForward.Config(dim=dim, hidden_dim=128)}),
                block({"moe": MoE.Config(dim=dim, hidden_dim=32, num_experts=4, top_k=2)})],
        norm=RMSNorm.Config(hidden=dim),
        output=Linear.Config(in_features=dim, out_features=256, bias=False),
    )
