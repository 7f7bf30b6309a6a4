"""MoE decoder: every layer sparse; router ``wg`` (Linear with bias) whose softmax runs over
ALL experts BEFORE top-k (weights not renormalized), experts in a ModuleList
(``experts[j].lin1/lin2``, GELU), a shared expert ``shared`` gated by
``sigmoid(shared_gate(x))`` with shared_gate = Linear(hidden, 1), SDPA attention with
projections ``query/key/value/dense`` (views with -1 heads), tied input/output
embeddings (``embed`` / ``lm_head``). Loss through self.loss_function.

What it exercises (found by an adversarial try of the dataflow planner): more experts than
layers (the decoder layers are not the longest ModuleList), ``torch.zeros_like`` as the
routed output's accumulator (a fresh tensor, not the block's input added back), a bias
on each expert's second linear (computed as DTensor under tp, on flattened tokens under
cp), and router and gate weights that multiply expert outputs (under sequence parallel
their gradients would be partial sums if the experts handed theirs on)."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_moe_tied import MoETiedConfig


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size, bias=True)
        self.key = nn.Linear(config.hidden_size, config.hidden_size, bias=True)
        self.value = nn.Linear(config.hidden_size, config.hidden_size, bias=True)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(b, s, -1))


class Expert(nn.Module):
    def __init__(self, hidden, inner):
        super().__init__()
        self.lin1 = nn.Linear(hidden, inner, bias=False)
        self.lin2 = nn.Linear(inner, hidden, bias=True)

    def forward(self, x):
        return self.lin2(F.gelu(self.lin1(x)))


class MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.wg = nn.Linear(config.hidden_size, config.num_experts, bias=True)
        self.experts = nn.ModuleList(Expert(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        self.shared = Expert(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x):
        shape = x.shape
        t = x.reshape(-1, shape[-1])
        probs = F.softmax(self.wg(t), dim=-1, dtype=torch.float32).to(t.dtype)  # before top-k
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        out = torch.zeros_like(t)
        for j, expert in enumerate(self.experts):
            token, slot = torch.where(index == j)
            out.index_add_(0, token, weights[token, slot, None] * expert(t[token]))
        out = out + torch.sigmoid(self.shared_gate(t)) * self.shared(t)
        return out.view(shape)


class Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.post_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.moe = MoE(config)

    def forward(self, x):
        x = x + self.attention(self.input_norm(x))
        return x + self.moe(self.post_norm(x))


class MoETiedPreTrainedModel(PreTrainedModel):
    config_class = MoETiedConfig
    base_model_prefix = "body"
    _no_split_modules = ["Layer"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.normal_(mean=0.0, std=std)
        if isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)


class MoETiedModel(MoETiedPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def forward(self, input_ids, **kwargs):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class MoETiedForCausalLM(MoETiedPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "body.embed.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.body = MoETiedModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.body.embed

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids, labels=None, **kwargs):
        logits = self.lm_head(self.body(input_ids))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutput(loss=loss, logits=logits)
