"""The list-of-experts MoE decoder: experts as an ``nn.ModuleList`` of small MLPs, the way
many remote-code MoE models (and older transformers ports) write them.

What it exercises: attention projections named ``attn.query/key/value/out`` (multi-head,
4 heads), learned absolute position embeddings beside the token embedding, LayerNorm
pre-norm, and alternating layer kinds: every second layer a sparse block ``moe`` with a
``router`` Linear (top-2 of 4 experts, softmax over the top-k logits), experts
``experts[j].fc_in/fc_out`` (GELU) in a ModuleList, dispatched by a loop over experts with
``index_add_``, plus a ``shared_expert`` MLP every token goes through; the other layers a
dense ``mlp.fc_in/fc_out`` of the same class as the experts. The head is untied and named
``head``; the loss goes through transformers' ``self.loss_function`` as recent ports do
(the other fixtures compute their cross entropy inline). No module name here is one of
transformers' own.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from .configuration_list_moe import ListMoEConfig


class SelfAttention(nn.Module):
    def __init__(self, config: ListMoEConfig):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.key = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.value = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.out = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden):
        batch, seq, _ = hidden.shape
        # -1: the heads this process holds (all of them, or a tensor-parallel share)
        q, k, v = (proj(hidden).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attn.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, inner_size: int):
        super().__init__()
        self.fc_in = nn.Linear(hidden_size, inner_size, bias=False)
        self.fc_out = nn.Linear(inner_size, hidden_size, bias=False)

    def forward(self, hidden):
        return self.fc_out(F.gelu(self.fc_in(hidden)))


class SparseMoE(nn.Module):
    def __init__(self, config: ListMoEConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size)

    def forward(self, hidden):
        shape = hidden.shape
        tokens = hidden.reshape(-1, shape[-1])
        top_logits, top_index = self.router(tokens).topk(self.top_k, dim=-1)
        weights = top_logits.softmax(dim=-1)  # softmax over the chosen experts only
        routed = torch.zeros_like(tokens)
        for j, expert in enumerate(self.experts):
            token, slot = torch.where(top_index == j)  # every expert runs, on zero tokens if none chose it
            routed.index_add_(0, token, weights[token, slot, None] * expert(tokens[token]))
        return (routed + self.shared_expert(tokens)).view(shape)


class ListMoELayer(nn.Module):
    def __init__(self, config: ListMoEConfig, layer_idx: int):
        super().__init__()
        self.is_moe = (layer_idx + 1) % config.moe_every == 0
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = SelfAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if self.is_moe:
            self.moe = SparseMoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, hidden):
        hidden = hidden + self.attn(self.norm1(hidden))
        ffn = self.moe if self.is_moe else self.mlp
        return hidden + ffn(self.norm2(hidden))


class ListMoEPreTrainedModel(PreTrainedModel):
    config_class = ListMoEConfig
    base_model_prefix = "backbone"
    _no_split_modules = ["ListMoELayer"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=std)
        if isinstance(module, nn.LayerNorm):
            module.weight.data.fill_(1.0)
            module.bias.data.zero_()


class ListMoEModel(ListMoEPreTrainedModel):
    def __init__(self, config: ListMoEConfig):
        super().__init__(config)
        self.token_embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos_embed = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(ListMoELayer(config, i) for i in range(config.num_hidden_layers))
        self.norm_out = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.token_embed

    def set_input_embeddings(self, value):
        self.token_embed = value

    def forward(self, input_ids, position_ids=None, **kwargs):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden = self.token_embed(input_ids) + self.pos_embed(position_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return BaseModelOutput(last_hidden_state=self.norm_out(hidden))


class ListMoEForCausalLM(ListMoEPreTrainedModel):
    def __init__(self, config: ListMoEConfig):
        super().__init__(config)
        self.backbone = ListMoEModel(config)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.backbone.token_embed

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, labels=None, position_ids=None, **kwargs):
        logits = self.head(self.backbone(input_ids, position_ids=position_ids).last_hidden_state)
        loss = None
        if labels is not None:  # transformers' causal-LM loss: position t predicts label t + 1
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutput(loss=loss, logits=logits)
