"""Decoder-only transformer: ``TransformerBlock`` (pre-norm attention + FFN or MoE) and
``Decoder`` (embedding → blocks → norm → output projection).

Every layer has its own ``TransformerBlock.Config`` in ``Decoder.Config.layers`` so that
dense and MoE layers can mix (HF ``mlp_only_layers`` / ``decoder_sparse_step``) and so
that the sharding helpers can write each layer's plan. ``DecoderBlock`` is the same
class under the name the RFC uses for the per-layer config (``DecoderBlock.Config``).

``init_states`` (from ``Module``) initializes every parameter and rebuilds the RoPE
cos/sin cache on ``buffer_device`` (default: where the cache already lives), which is
what a model built on the meta device needs after ``to_empty``.
"""

from dataclasses import dataclass

import torch

from hyper_parallel import platform
from hyper_parallel.models.common.attention import GQAttention
from hyper_parallel.models.common.embedding import Embedding
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.moe import MoE
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.models.common.rope import RoPE
from hyper_parallel.protocols import BaseModel, Module


class TransformerBlock(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        attention: GQAttention.Config
        attention_norm: RMSNorm.Config
        ffn_norm: RMSNorm.Config
        feed_forward: FeedForward.Config | None = None
        moe: MoE.Config | None = None

        def __post_init__(self) -> None:
            if (self.feed_forward is None) == (self.moe is None):
                raise ValueError("TransformerBlock.Config needs exactly one of feed_forward and moe, got "
                                 f"feed_forward={self.feed_forward is not None}, moe={self.moe is not None}")

    def __init__(self, config: "TransformerBlock.Config"):
        Module.__init__(self, config)
        self.attention_norm = config.attention_norm.build()
        self.attention = config.attention.build()
        self.ffn_norm = config.ffn_norm.build()
        if config.moe is not None:
            self.moe = config.moe.build()
        else:
            self.feed_forward = config.feed_forward.build()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        ffn = self.moe if self.config.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))


DecoderBlock = TransformerBlock


class Decoder(BaseModel):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        tok_embeddings: Embedding.Config
        rope: RoPE.Config
        layers: list[TransformerBlock.Config]
        norm: RMSNorm.Config
        output: Linear.Config

        def __post_init__(self) -> None:
            dim = self.tok_embeddings.embedding_dim
            if self.output.in_features != dim or self.norm.hidden != dim:
                raise ValueError(f"Decoder.Config: tok_embeddings dim {dim} disagrees with "
                                 f"norm.hidden={self.norm.hidden} / output.in_features={self.output.in_features}")

    def __init__(self, config: "Decoder.Config"):
        Module.__init__(self, config)
        self.tok_embeddings = config.tok_embeddings.build()
        self.rope = config.rope.build()
        self.layers = platform.ModuleList([layer.build() for layer in config.layers])
        self.norm = config.norm.build()
        self.output = config.output.build()

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens`` [b, s] → logits [b, s, vocab]; positions default to ``0 .. s-1``."""
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope(h, position_ids)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))
