"""A linear-attention hybrid decoder written as remote code, with names no transformers
family uses: recurrent layers (``retention``) between full-attention layers (``softmax``).

What it exercises: a recurrent mixer whose own code runs per head, as gated delta-nets do:
one projection packing ``[q | k | v]`` (``to_qkv``), a depthwise causal convolution over
those channels applied through its weight (``F.conv1d(x, self.smooth.weight)``, never the
module), a learned per-head decay (``decay``, one entry per head), an exponentially decayed
causal linear attention, a per-head norm (``head_norm``, one weight shared by every head),
a sigmoid output gate (``gate``) and an output projection (``merge``); its reshapes and
splits use its own sizes (``self.n_heads``, ``self.inner``), not ``-1``. The full-attention
layers use ``-1``. Pre-norm residual blocks, a gated MLP (``up``/``gate``/``down`` named
``w_in``/``w_gate``/``w_out``), an untied head.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_linear_hybrid import LinearHybridConfig


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Retention(nn.Module):
    def __init__(self, config: LinearHybridConfig, layer_idx: int):
        super().__init__()
        self.n_heads, self.head_dim = config.retention_heads, config.retention_head_dim
        self.inner = self.n_heads * self.head_dim
        self.layer_idx = layer_idx
        self.to_qkv = nn.Linear(config.d_model, 3 * self.inner, bias=False)
        self.smooth = nn.Conv1d(3 * self.inner, 3 * self.inner, config.conv_width, groups=3 * self.inner,
                                padding=config.conv_width - 1, bias=False)
        self.decay = nn.Parameter(torch.linspace(-1.0, 1.0, self.n_heads))
        self.head_norm = Norm(self.head_dim, config.norm_eps)
        self.gate = nn.Linear(config.d_model, self.inner, bias=False)
        self.merge = nn.Linear(self.inner, config.d_model, bias=False)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        mixed = F.conv1d(self.to_qkv(x).transpose(1, 2), self.smooth.weight, padding=self.smooth.padding[0],
                         groups=3 * self.inner)[..., :seqlen].transpose(1, 2)
        q, k, v = torch.split(F.silu(mixed), [self.inner, self.inner, self.inner], dim=-1)
        q, k, v = (t.reshape(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        # decayed causal linear attention: o_i = sum_{j <= i} a^(i - j) (q_i . k_j) v_j, a per head
        steps = torch.arange(seqlen, device=x.device)
        distance = (steps[:, None] - steps[None, :]).clamp(min=0).float()
        rate = torch.sigmoid(self.decay).log()[:, None, None]  # [heads, 1, 1], log a < 0
        weights = torch.exp(rate * distance) * (steps[:, None] >= steps[None, :])
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        out = torch.matmul(scores * weights, v).transpose(1, 2)  # [bsz, seq, heads, head_dim]
        out = self.head_norm(out).reshape(bsz, seqlen, self.inner)
        return self.merge(out * torch.sigmoid(self.gate(x)))


class Softmax(nn.Module):
    def __init__(self, config: LinearHybridConfig):
        super().__init__()
        self.head_dim = config.d_model // config.softmax_heads
        self.wqkv = nn.ModuleList(nn.Linear(config.d_model, config.d_model, bias=False) for _ in range(3))
        self.wo = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        q, k, v = (proj(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2) for proj in self.wqkv)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = scores + torch.full((seqlen, seqlen), float("-inf"), device=x.device).triu(1)
        out = torch.matmul(F.softmax(scores.float(), dim=-1).type_as(q), v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class Block(nn.Module):
    def __init__(self, config: LinearHybridConfig, layer_idx: int):
        super().__init__()
        full = (layer_idx + 1) % config.softmax_every == 0
        self.mixer = Softmax(config) if full else Retention(config, layer_idx)
        self.mix_norm = Norm(config.d_model, config.norm_eps)
        self.ffn_norm = Norm(config.d_model, config.norm_eps)
        self.w_in = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.w_gate = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.w_out = nn.Linear(config.ffn_dim, config.d_model, bias=False)

    def forward(self, x):
        h = x + self.mixer(self.mix_norm(x))
        y = self.ffn_norm(h)
        return h + self.w_out(F.silu(self.w_gate(y)) * self.w_in(y))


class LinearHybridPreTrainedModel(PreTrainedModel):
    config_class = LinearHybridConfig
    base_model_prefix = "trunk"
    _no_split_modules = ["Block"]

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d)):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, Norm):
            module.weight.data.fill_(1.0)
        elif isinstance(module, Retention):
            module.decay.data.copy_(torch.linspace(-1.0, 1.0, module.n_heads))


class Trunk(nn.Module):
    def __init__(self, config: LinearHybridConfig):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.depth))
        self.final_norm = Norm(config.d_model, config.norm_eps)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.final_norm(h)


class LinearHybridForCausalLM(LinearHybridPreTrainedModel):
    def __init__(self, config: LinearHybridConfig):
        super().__init__(config)
        self.trunk = Trunk(config)
        self.unembed = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.trunk.embed

    def set_input_embeddings(self, value):
        self.trunk.embed = value

    def get_output_embeddings(self):
        return self.unembed

    def forward(self, input_ids, labels=None, **kwargs):
        logits = self.unembed(self.trunk(input_ids)).float()
        loss = None
        if labels is not None:  # next-token prediction: position t predicts label t + 1
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
