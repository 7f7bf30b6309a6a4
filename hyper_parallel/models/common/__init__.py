"""torchtitan-style model components on the Module/Config protocol (RFC Part 4)."""

from hyper_parallel.models.common.attention import BaseAttention, GQAttention
from hyper_parallel.models.common.decoder import Decoder, DecoderBlock, TransformerBlock
from hyper_parallel.models.common.decoder_sharding import (
    colwise_config,
    dense_activation_placement,
    dense_param_placement,
    norm_config,
    rowwise_config,
    set_decoder_sharding_config,
    set_dense_ffn_sharding,
    set_gqa_attention_sharding,
    set_qkv_linear_sharding,
)
from hyper_parallel.models.common.embedding import Embedding
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.moe import MoE, Experts, Router, SharedExpertMoE
from hyper_parallel.models.common.param_init import kaiming_uniform_, normal_, ones_, xavier_normal_, zeros_
from hyper_parallel.models.common.rmsnorm import Qwen3_5RMSNorm, RMSNorm
from hyper_parallel.models.common.rope import RoPE, apply_rotary_pos_emb

__all__ = [
    "BaseAttention",
    "Decoder",
    "DecoderBlock",
    "Embedding",
    "Experts",
    "FeedForward",
    "GQAttention",
    "Linear",
    "MoE",
    "Qwen3_5RMSNorm",
    "RMSNorm",
    "RoPE",
    "Router",
    "SharedExpertMoE",
    "TransformerBlock",
    "apply_rotary_pos_emb",
    "colwise_config",
    "dense_activation_placement",
    "dense_param_placement",
    "kaiming_uniform_",
    "norm_config",
    "normal_",
    "ones_",
    "rowwise_config",
    "set_decoder_sharding_config",
    "set_dense_ffn_sharding",
    "set_gqa_attention_sharding",
    "set_qkv_linear_sharding",
    "xavier_normal_",
    "zeros_",
]
