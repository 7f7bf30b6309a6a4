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
from hyper_parallel.models.common.causal_lm import CausalLMOutput, causal_lm_loss
from hyper_parallel.models.common.embedding import Embedding
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.moe import MoE
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.models.common.rope import RoPE
from hyper_parallel.protocols import BaseModel, Module


class TransformerBlock(Module):
    # HF decoder-layer names → ours, relative to the block (how a checkpoint of the HF
    # model of the same config fills this one; distributed/weight_map.py composes them
    # after transformers' own conversion, e.g. per-expert tensors stacked into experts).
    checkpoint_conversion = (
        (r"^input_layernorm", "attention_norm"),
        (r"^post_attention_layernorm", "ffn_norm"),
        (r"^self_attn", "attention"),
        (r"^mlp\.gate_proj", "feed_forward.w1"),
        (r"^mlp\.up_proj", "feed_forward.w3"),
        (r"^mlp\.down_proj", "feed_forward.w2"),
        (r"^mlp\.gate", "moe.router"),
        (r"^mlp\.experts", "moe.experts"),
    )

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
    # FSDP2 wraps these blocks one by one (distributed/fsdp.py reads HF's attribute name).
    _no_split_modules = ("TransformerBlock",)
    # HF causal-LM names → ours (the blocks rename inside each layer; see TransformerBlock).
    checkpoint_conversion = (
        (r"^model\.embed_tokens", "tok_embeddings"),
        (r"^model\.layers", "layers"),
        (r"^model\.norm", "norm"),
        (r"^lm_head", "output"),
    )

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

        # The sizes the trainer and its FLOPs count read off an HF config, under HF's names.
        @property
        def vocab_size(self) -> int:
            return self.output.out_features

        @property
        def hidden_size(self) -> int:
            return self.tok_embeddings.embedding_dim

        @property
        def num_hidden_layers(self) -> int:
            return len(self.layers)

        @property
        def num_attention_heads(self) -> int:
            return self.layers[0].attention.n_heads

        @property
        def head_dim(self) -> int:
            return self.layers[0].attention.head_dim

        @property
        def num_experts(self) -> int | None:
            moe = next((layer.moe for layer in self.layers if layer.moe is not None), None)
            return moe.num_experts if moe is not None else None

        @property
        def num_experts_per_tok(self) -> int | None:
            moe = next((layer.moe for layer in self.layers if layer.moe is not None), None)
            return moe.top_k if moe is not None else None

    def __init__(self, config: "Decoder.Config"):
        Module.__init__(self, config)
        self.tok_embeddings = config.tok_embeddings.build()
        self.rope = config.rope.build()
        self.layers = platform.ModuleList([layer.build() for layer in config.layers])
        self.norm = config.norm.build()
        self.output = config.output.build()
        # HF's hook name: the applier swaps in the sharded cross entropy when the plan
        # leaves the logits sharded (models/common/causal_lm.py).
        self.loss_function = causal_lm_loss

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.tok_embeddings

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.output

    def forward(self, tokens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None, *,
                input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None):
        """``tokens`` [b, s] → logits [b, s, vocab]; positions default to ``0 .. s-1``.
        Called as a causal LM (``input_ids=``, optionally ``labels=``) it returns a
        ``CausalLMOutput`` with HF's loss (labels shifted inside) when labels are given."""
        ids = tokens if tokens is not None else input_ids
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        h = self.tok_embeddings(ids)
        cos, sin = self.rope(h, position_ids)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        if tokens is not None and labels is None:
            return logits
        loss = self.loss_function(logits, labels, self.config.vocab_size) if labels is not None else None
        return CausalLMOutput(loss=loss, logits=logits)
