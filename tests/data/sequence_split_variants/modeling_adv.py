"""A small remote-code decoder whose ``config.variant`` adds one way of code breaking a
sequence split (token shifts between blocks or layers, zero-initialized gates and
buffers, reshapes to the whole length, blocks handing out parameters, ...): the cases
of tests/distributed/test_sequence_dry_run.py. Not a remote_code fixture of the sweep."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, GenerationMixin
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from .configuration_adv import AdvConfig


def shift(x, dim=1):
    """token shift: each token gets the previous one (zero for the first)"""
    return F.pad(x, (0, 0, 1, -1)) if dim == 1 else F.pad(x, (0, 0, 0, 0, 1, -1))


class AdvRMSNorm(nn.Module):
    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, hidden):
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hidden


class AdvAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.variant = config.variant
        self.head_dim = config.head_dim
        width = config.num_attention_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.o_proj = nn.Linear(width, config.hidden_size, bias=False)
        if self.variant in ("handout_view", "handout_inside", "handout_list", "handout_mlp_uses"):
            self.out_bias = nn.Parameter(torch.zeros(config.hidden_size))

    def forward(self, hidden, residual=None):
        seq_first = self.variant == "seq_first"
        if seq_first:
            hidden = hidden.transpose(0, 1)
        batch, seq, _ = hidden.shape
        q, k, v = (p(hidden).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.variant == "sigmoid_attn":  # sigmoid attention (no softmax), causal
            scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5
            causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
            probs = torch.sigmoid(scores).masked_fill(~causal, 0.0)
            out = probs @ v
        elif self.variant == "linear_attn":  # causal linear attention through a cumulative sum
            kv = torch.einsum("bhsd,bhse->bhsde", F.elu(k) + 1, v).cumsum(2)
            out = torch.einsum("bhsd,bhsde->bhse", F.elu(q) + 1, kv) / seq
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
        if seq_first:
            out = out.transpose(0, 1)
        if residual is not None:  # Bloom-style: the block adds the residual itself
            out = out + residual
            if self.variant == "bloom_two_out":
                return out, out.mean(-1)
        if self.variant == "handout_view":
            return out, self.out_bias.view(1, 1, -1)
        if self.variant == "handout_inside":
            return out + self.out_bias, self.out_bias
        if self.variant == "handout_list":
            return [out, self.out_bias]
        if self.variant == "handout_mlp_uses":
            return out, self.out_bias
        return out


class AdvMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.variant = config.variant
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden, residual=None, extra=None):
        if extra is not None:
            hidden = hidden + extra
        inner = F.silu(self.gate_proj(hidden)) * self.up_proj(hidden)
        if self.variant == "cumsum_mlp":  # causal running mean over the sequence inside the MLP
            counts = torch.arange(1, inner.shape[1] + 1, device=inner.device, dtype=inner.dtype)
            inner = inner.cumsum(1) / counts[None, :, None]
        out = self.down_proj(inner)
        if residual is not None:
            out = out + residual
        return out


class AdvLayer(nn.Module):
    def __init__(self, config, index):
        super().__init__()
        self.variant = config.variant
        self.input_layernorm = AdvRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = AdvAttention(config)
        self.post_attention_layernorm = AdvRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = AdvMLP(config)
        if self.variant == "zero_shift":
            # a learned token-shift gate, zero at init (ReZero / RWKV-style time mix)
            self.shift_gate = nn.Parameter(torch.zeros(config.hidden_size))
        if self.variant == "buffer_shift":
            # a fixed (non-trained) token-shift mix read from the checkpoint; zero in a fresh model
            self.register_buffer("shift_mix", torch.zeros(config.hidden_size))

    def forward(self, hidden, extra=None):
        v = self.variant
        if v in ("bloom_kw", "bloom_two_out"):
            out = self.self_attn(self.input_layernorm(hidden), residual=hidden)
            hidden = out[0] if isinstance(out, tuple) else out
            return self.mlp(self.post_attention_layernorm(hidden), residual=hidden)
        attn = self.self_attn(self.input_layernorm(hidden))
        if v in ("handout_view", "handout_inside", "handout_list", "handout_mlp_uses"):
            attn, bias = attn
            if v == "handout_mlp_uses":
                hidden = hidden + attn
                return hidden + self.mlp(self.post_attention_layernorm(hidden), extra=bias)
            attn = attn + bias.expand_as(attn)
        hidden = hidden + attn
        if v == "zero_shift":
            hidden = hidden + self.shift_gate * shift(hidden)
        if v == "buffer_shift":
            hidden = hidden + self.shift_mix * shift(hidden)
        if v == "shift_between_blocks":
            hidden = hidden + 0.5 * shift(hidden)
        out = hidden + self.mlp(self.post_attention_layernorm(hidden))
        if extra is not None:  # a per-layer input made on the whole sequence (Gemma 4's per-layer embeddings)
            out = out + 0.5 * (shift(extra) if v == "per_layer_input_shift" else extra)
        return out


class AdvPreTrainedModel(PreTrainedModel):
    config_class = AdvConfig
    base_model_prefix = "model"
    _no_split_modules = ["AdvLayer"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()
        if isinstance(module, AdvRMSNorm):
            module.weight.data.fill_(1.0)
        if isinstance(module, AdvLayer) and hasattr(module, "shift_gate"):
            module.shift_gate.data.zero_()
        if isinstance(module, AdvLayer) and hasattr(module, "shift_mix"):
            module.shift_mix.data.zero_()
        if isinstance(module, AdvAttention) and hasattr(module, "out_bias"):
            module.out_bias.data.normal_(mean=0.0, std=0.5)


class AdvModel(AdvPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.variant = config.variant
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(AdvLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = AdvRMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.variant in ("view_full_proj", "view_full_skip"):
            self.extra_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        if self.variant == "smoother_after_norm":
            self.smoother = nn.Conv1d(config.hidden_size, config.hidden_size, 2, groups=config.hidden_size)
        if self.variant in ("per_layer_input", "per_layer_input_shift"):
            self.per_layer_embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids, **kwargs):
        v = self.variant
        batch, seq = input_ids.shape
        hidden = self.embed_tokens(input_ids)
        if v in ("shared_norm", "shared_norm_view"):  # the final norm also normalizes the embeddings
            hidden = self.norm(hidden)
        if v == "seq_first":
            hidden = hidden.transpose(0, 1).contiguous()
        repeats = 2 if v == "layers_twice" else 1
        for _ in range(repeats):
            for index, layer in enumerate(self.layers):
                if v == "shift_between_layers_only" and index > 0:
                    hidden = hidden + 0.5 * shift(hidden)  # mixes tokens between two layers
                hidden = layer(hidden, self.per_layer_embed(input_ids)) if hasattr(self, "per_layer_embed") else \
                    layer(hidden)
                if v == "shift_between_layers":
                    hidden = hidden + 0.5 * shift(hidden)
        if v == "seq_first":
            hidden = hidden.transpose(0, 1)
        if v == "shift_before_norm":
            hidden = hidden + 0.5 * shift(hidden)
        out = self.norm(hidden)
        if v in ("view_full", "view_full_tied", "view_full_proj", "view_full_skip", "shared_norm_view"):
            out = out.view(batch, seq, -1)  # GPT-2 style reshape to the whole length
        if v == "view_full_mean":  # GPT-2 reshape, plus a summary of the whole sequence read off the layers
            out = out.view(batch, seq, -1) + hidden.mean(1, keepdim=True)
        if v == "view_full_proj":  # OPT-style project_out after the final norm
            out = self.extra_proj(out)
        if v == "view_full_skip":  # a second reader of the layers' output
            out = out + self.extra_proj(hidden)
        if v == "cumsum_after_norm":
            counts = torch.arange(1, out.shape[1] + 1, dtype=out.dtype)
            out = out.cumsum(1) / counts[None, :, None]
        if v == "smoother_after_norm":
            out = self.smoother(F.pad(out.transpose(1, 2), (1, 0))).transpose(1, 2)
        return BaseModelOutput(last_hidden_state=out)


class AdvForCausalLM(AdvPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = AdvModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, labels=None, **kwargs):
        if self.config.variant == "labels_shift_hidden":  # training path: drop the last position before the head
            hidden = self.model(input_ids).last_hidden_state
            if labels is not None:
                logits = self.lm_head(hidden[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
                return CausalLMOutput(loss=loss, logits=logits)
            return CausalLMOutput(logits=self.lm_head(hidden))
        logits = self.lm_head(self.model(input_ids).last_hidden_state)
        if self.config.variant == "logits_view":  # reshape of the logits to the whole length
            logits = logits.view(input_ids.shape[0], input_ids.shape[1], -1)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutput(loss=loss, logits=logits)
