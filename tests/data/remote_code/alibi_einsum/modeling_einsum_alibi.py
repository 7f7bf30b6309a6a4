"""Einsum attention with an interleaved fused c_qkv ([h0: q k v | h1: q k v | ...]), explicit
softmax (no SDPA), ALiBi bias, GELU MLP named up/down, parallel residual (GPT-NeoX style:
x + attn(ln_1(x)) + mlp(ln_2(x))). Loss through self.loss_function.

What it exercises (found by an adversarial try of the dataflow planner): with
``alibi_from_tensor`` (this fixture's config) the ALiBi slopes are built for the heads the
tensor holds, so on a tensor-parallel share the code runs but gives rank r the slopes of
heads 0.. instead of its own: a split that runs and computes other values. The dry run
compares each rank's share with the unsplit model's and plans the attention gathered."""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from .configuration_einsum_alibi import EinsumAlibiConfig


def alibi_slopes(n: int, device=None) -> torch.Tensor:
    start = 2 ** (-8.0 / n)
    return torch.tensor([start ** (i + 1) for i in range(n)], device=device, dtype=torch.float32)


class EinsumAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.alibi_from_tensor = config.alibi_from_tensor
        self.c_qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=True)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=True)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.c_qkv(x).view(b, s, -1, 3, self.head_dim)  # per head: q, k, v
        q, k, v = qkv.unbind(dim=3)  # [b, s, h, d]
        h = q.shape[2]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim)
        slopes = alibi_slopes(h if self.alibi_from_tensor else self.n_head, x.device)
        pos = torch.arange(s, device=x.device, dtype=torch.float32)
        rel = (pos[None, :] - pos[:, None])  # k - q, <= 0 on the causal side
        scores = scores + slopes[:, None, None] * rel[None]
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1)
        return self.c_proj(out)


class UpDownMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up = nn.Linear(config.n_embd, config.n_inner, bias=True)
        self.down = nn.Linear(config.n_inner, config.n_embd, bias=True)

    def forward(self, x):
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class ParallelBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = EinsumAttention(config)
        self.mlp = UpDownMLP(config)

    def forward(self, x):
        return x + self.attn(self.ln_1(x)) + self.mlp(self.ln_2(x))


class EinsumAlibiPreTrainedModel(PreTrainedModel):
    config_class = EinsumAlibiConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["ParallelBlock"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.normal_(mean=0.0, std=std)
        if isinstance(module, nn.LayerNorm):
            module.weight.data.fill_(1.0)
            module.bias.data.zero_()


class EinsumAlibiModel(EinsumAlibiPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList(ParallelBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, value):
        self.wte = value

    def forward(self, input_ids, **kwargs):
        x = self.wte(input_ids)
        for block in self.h:
            x = block(x)
        return BaseModelOutput(last_hidden_state=self.ln_f(x))


class EinsumAlibiForCausalLM(EinsumAlibiPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.transformer = EinsumAlibiModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.wte

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids, labels=None, **kwargs):
        logits = self.lm_head(self.transformer(input_ids).last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutput(loss=loss, logits=logits)
