"""The fused-GQA parallel-block decoder: a GPT-J/Falcon-7B style block written as a
remote-code model.

What it exercises: one fused ``query_key_value`` projection whose q, k and v parts have
unequal widths (4 query heads, 2 kv heads: ``[q | k | v]`` = 64 | 32 | 32 columns), a
parallel block (attention and MLP read the same LayerNorm output and both are added to
the residual: ``x + attn(ln(x)) + mlp(ln(x))``), LayerNorm with a bias, biases on every
projection (``query_key_value``, ``dense``, ``dense_h_to_4h``, ``dense_4h_to_h``), a GELU
MLP, rotary embeddings computed in the attention module, and input/output embeddings tied
through transformers' ``_tied_weights_keys`` (one tensor in the checkpoint). The q/k/v
split is computed from the projection's output width, so a tensor-parallel share of each
part (``[q_r | k_r | v_r]``) runs the same code.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from .configuration_fused_gqa import FusedGQAConfig


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_cos_sin(head_dim, seq_len, theta, device):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # [seq, head_dim]
    return emb.cos(), emb.sin()


class FusedGQAAttention(nn.Module):
    def __init__(self, config: FusedGQAConfig):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.groups = config.num_attention_heads // config.num_kv_heads  # query heads per kv head
        self.rope_theta = config.rope_theta
        fused = (config.num_attention_heads + 2 * config.num_kv_heads) * self.head_dim
        self.query_key_value = nn.Linear(config.hidden_size, fused, bias=True)  # [q | k | v]
        self.dense = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=True)

    def forward(self, hidden):
        batch, seq, _ = hidden.shape
        qkv = self.query_key_value(hidden)
        kv_width = qkv.shape[-1] // (self.groups + 2)  # width of k (and of v) in this process
        query, key, value = qkv.split([self.groups * kv_width, kv_width, kv_width], dim=-1)
        query, key, value = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (query, key, value))
        cos, sin = rotary_cos_sin(self.head_dim, seq, self.rope_theta, hidden.device)
        query = query * cos + rotate_half(query) * sin
        key = key * cos + rotate_half(key) * sin
        key = key.repeat_interleave(self.groups, dim=1)
        value = value.repeat_interleave(self.groups, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(batch, seq, -1))


class FusedGQAMLP(nn.Module):
    def __init__(self, config: FusedGQAConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=True)
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=True)

    def forward(self, hidden):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(hidden)))


class FusedGQABlock(nn.Module):
    def __init__(self, config: FusedGQAConfig):
        super().__init__()
        self.ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attention = FusedGQAAttention(config)
        self.mlp = FusedGQAMLP(config)

    def forward(self, hidden):
        normed = self.ln(hidden)  # one norm feeds both branches
        return hidden + self.attention(normed) + self.mlp(normed)


class FusedGQAPreTrainedModel(PreTrainedModel):
    config_class = FusedGQAConfig
    base_model_prefix = "decoder"
    _no_split_modules = ["FusedGQABlock"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()
        if isinstance(module, nn.LayerNorm):
            module.weight.data.fill_(1.0)
            module.bias.data.zero_()


class FusedGQAModel(FusedGQAPreTrainedModel):
    def __init__(self, config: FusedGQAConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(FusedGQABlock(config) for _ in range(config.n_layer))
        self.final_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def forward(self, input_ids, **kwargs):
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        return BaseModelOutput(last_hidden_state=self.final_ln(hidden))


class FusedGQAForCausalLM(FusedGQAPreTrainedModel):
    _tied_weights_keys = {"lm_out.weight": "decoder.embed.weight"}  # used when config.tie_word_embeddings

    def __init__(self, config: FusedGQAConfig):
        super().__init__(config)
        self.decoder = FusedGQAModel(config)
        self.lm_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.decoder.embed

    def get_output_embeddings(self):
        return self.lm_out

    def set_output_embeddings(self, value):
        self.lm_out = value

    def forward(self, input_ids, labels=None, **kwargs):
        logits = self.lm_out(self.decoder(input_ids).last_hidden_state)
        loss = None
        if labels is not None:  # next-token prediction: position t predicts label t + 1
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
