"""The embedding-skip decoder: every decoder layer adds a learned share of the normed
input embeddings (``x0``, computed once in the base model's forward) to its input, a
skip connection from the embeddings to every depth.

The hidden states flow from layer to layer untouched, so the pipeline hand-off check
passes; but a later pipeline stage, fed hidden states as ``inputs_embeds``, computes its
``x0`` from them and not from the embeddings: only running the stages (verify) shows it.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from .configuration_embedding_skip import EmbeddingSkipConfig


class SkipRMSNorm(nn.Module):
    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, hidden):
        return self.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)


class SkipAttention(nn.Module):
    def __init__(self, config: EmbeddingSkipConfig):
        super().__init__()
        self.head_dim = config.head_dim
        width = config.num_attention_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.o_proj = nn.Linear(width, config.hidden_size, bias=False)

    def forward(self, hidden):
        batch, seq, _ = hidden.shape
        query, key, value = (proj(hidden).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                             for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class SkipMLP(nn.Module):
    def __init__(self, config: EmbeddingSkipConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden):
        return self.down_proj(F.silu(self.up_proj(hidden)))


class EmbeddingSkipLayer(nn.Module):
    def __init__(self, config: EmbeddingSkipConfig):
        super().__init__()
        self.x0_scale = nn.Parameter(torch.full((config.hidden_size,), 0.5))
        self.input_layernorm = SkipRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = SkipAttention(config)
        self.post_attention_layernorm = SkipRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = SkipMLP(config)

    def forward(self, hidden, x0):
        hidden = hidden + self.x0_scale * x0
        hidden = hidden + self.self_attn(self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class EmbeddingSkipPreTrainedModel(PreTrainedModel):
    config_class = EmbeddingSkipConfig
    base_model_prefix = "model"
    _no_split_modules = ["EmbeddingSkipLayer"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=std)
        if isinstance(module, SkipRMSNorm):
            module.weight.data.fill_(1.0)
        if isinstance(module, EmbeddingSkipLayer):
            module.x0_scale.data.fill_(0.5)


class EmbeddingSkipModel(EmbeddingSkipPreTrainedModel):
    def __init__(self, config: EmbeddingSkipConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.x0_norm = SkipRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(EmbeddingSkipLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = SkipRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        x0 = self.x0_norm(hidden)
        for layer in self.layers:
            hidden = layer(hidden, x0)
        return BaseModelOutput(last_hidden_state=self.norm(hidden))


class EmbeddingSkipForCausalLM(EmbeddingSkipPreTrainedModel):
    def __init__(self, config: EmbeddingSkipConfig):
        super().__init__(config)
        self.model = EmbeddingSkipModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, labels=None, inputs_embeds=None, **kwargs):
        logits = self.lm_head(self.model(input_ids, inputs_embeds=inputs_embeds).last_hidden_state)
        loss = None
        if labels is not None:  # next-token prediction: position t predicts label t + 1
            loss = self.loss_function(logits, labels, self.config.vocab_size)
        return CausalLMOutput(loss=loss, logits=logits)
