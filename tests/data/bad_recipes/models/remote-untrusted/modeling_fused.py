"""The fused decoder: a decoder-only causal LM with fused q/k/v and gate/up projections
and q/k RMS norms over the whole projection (not per head).

Written the way remote-code models on the Hub are: a PreTrainedModel subclass whose
configuration class sits beside it in ``configuration_fused.py``.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from .configuration_fused import FusedDecoderConfig


class FusedRMSNorm(nn.Module):
    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, hidden):
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hidden.to(dtype)


class FusedAttention(nn.Module):
    def __init__(self, config: FusedDecoderConfig):
        super().__init__()
        self.head_dim = config.head_dim
        width = config.num_attention_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * width, bias=True)  # [q | k | v]
        self.q_norm = FusedRMSNorm(width, eps=config.rms_norm_eps)  # over the whole q projection
        self.k_norm = FusedRMSNorm(width, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(width, config.hidden_size, bias=False)

    def forward(self, hidden):
        batch, seq, _ = hidden.shape
        query, key, value = self.qkv_proj(hidden).chunk(3, dim=-1)
        query, key = self.q_norm(query), self.k_norm(key)
        # -1: the number of heads in this process (all of them, or a tensor-parallel share)
        query, key, value = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (query, key, value))
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class FusedMLP(nn.Module):
    def __init__(self, config: FusedDecoderConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden):
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class FusedDecoderLayer(nn.Module):
    def __init__(self, config: FusedDecoderConfig):
        super().__init__()
        self.input_layernorm = FusedRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = FusedAttention(config)
        self.post_attention_layernorm = FusedRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = FusedMLP(config)

    def forward(self, hidden):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class FusedDecoderPreTrainedModel(PreTrainedModel):
    config_class = FusedDecoderConfig
    base_model_prefix = "model"
    _no_split_modules = ["FusedDecoderLayer"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()
        if isinstance(module, FusedRMSNorm):
            module.weight.data.fill_(1.0)


class FusedDecoderModel(FusedDecoderPreTrainedModel):
    def __init__(self, config: FusedDecoderConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(FusedDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = FusedRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids, **kwargs):
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return BaseModelOutput(last_hidden_state=self.norm(hidden))


class FusedDecoderForCausalLM(FusedDecoderPreTrainedModel):
    def __init__(self, config: FusedDecoderConfig):
        super().__init__(config)
        self.model = FusedDecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids).last_hidden_state)
        loss = None
        if labels is not None:  # next-token prediction: position t predicts label t + 1
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
