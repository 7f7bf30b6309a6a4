"""A decoder-only family no planner table knows: fused qkv and gate/up projections,
q/k norms over the whole projection (not per head), causal attention, tied nothing.

Its parts only have the shapes real families have; the planner must classify them
from structure. ``build_fused_decoder(config_dir)`` reads ``config.json`` from a folder
like the HF families do. ``build_with_unclassifiable(config_dir)`` adds a module the
planner cannot place (a raw 2-D weight used as a matmul), to check its error.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutput


class FusedAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        width = config.num_attention_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * width, bias=True)  # [q | k | v], equal parts
        self.q_norm = nn.RMSNorm(width, eps=config.rms_norm_eps)  # over the whole q projection
        self.k_norm = nn.RMSNorm(width, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(width, config.hidden_size, bias=False)

    def forward(self, hidden):
        batch, seq, _ = hidden.shape
        q, k, v = self.qkv_proj(hidden).chunk(3, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        # -1: the number of heads this rank holds
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class FusedMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden):
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = FusedAttention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = FusedMLP(config)

    def forward(self, hidden):
        hidden = hidden + self.attn(self.attn_norm(hidden))
        return hidden + self.mlp(self.mlp_norm(hidden))


class FusedDecoderForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def get_input_embeddings(self):
        return self.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, labels=None):
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        logits = self.lm_head(self.norm(hidden))
        loss = None
        if labels is not None:  # next-token loss, as HF causal LMs compute it
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)


class MixingProjection(nn.Module):
    """A raw 2-D weight applied with a matmul: no name or type says how to shard it."""

    def __init__(self, size):
        super().__init__()
        self.mixer = nn.Parameter(torch.eye(size))

    def forward(self, hidden):
        return hidden @ self.mixer


def load_config(config_dir) -> SimpleNamespace:
    return SimpleNamespace(**json.loads(Path(config_dir, "config.json").read_text()))


def build_fused_decoder(config_dir) -> FusedDecoderForCausalLM:
    return FusedDecoderForCausalLM(load_config(config_dir))


def build_with_unclassifiable(config_dir) -> FusedDecoderForCausalLM:
    model = build_fused_decoder(config_dir)
    model.layers[1].attn.mixer = MixingProjection(model.config.hidden_size)
    return model
