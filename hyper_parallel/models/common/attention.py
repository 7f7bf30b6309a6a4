"""Attention: ``BaseAttention`` (the score/softmax/value core) and ``GQAttention``
(grouped-query attention with optional per-head qk-norm and output gate).

``BaseAttention`` has no parameters and works on per-head tensors only, so a sharding
plan can run it on local head shards (``local_map``) while the projections around it
stay distributed. It applies the rotary embedding too, because that is per-head math.

Numerics follow HF's eager path (Qwen3MoeAttention / Qwen3_5Attention): fp32 softmax
cast back to the query dtype, additive causal mask with the dtype's minimum.

Under context parallel that splits attention (the applier attaches a cp context,
``distributed.context_parallel``), ``BaseAttention`` gets this rank's tokens and does the
cp work itself: ``allgather_kv`` gathers K and V over cp and masks by this rank's global
query positions; ``ulysses`` exchanges q/k/v for the whole sequence of a group of heads
and the output back. The rotary tables come for the whole sequence and are cut to this
rank's positions (load-balanced or not) here.
"""

from dataclasses import dataclass

import torch

from hyper_parallel import platform
from hyper_parallel.distributed.context_parallel import (
    cp_context,
    gather_kv,
    ulysses_attention,
)
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.models.common.rope import apply_rotary_pos_emb
from hyper_parallel.protocols import Module


class BaseAttention(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        head_dim: int
        is_causal: bool = True
        dropout: float = 0.0

    # context parallel: this module does the cp work of allgather_kv and ulysses itself
    hyper_splits_attention_over_cp = True

    def __init__(self, config: "BaseAttention.Config"):
        Module.__init__(self, config)
        self.scaling = config.head_dim ** -0.5
        self.is_causal = config.is_causal  # read by context parallel's mask rows

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``q`` [b, heads, s, d], ``k``/``v`` [b, kv_heads, s, d] → [b, s, heads, d]."""
        context = cp_context(self)
        if context is not None and cos.shape[-2] == q.shape[2] * context.size:
            cos, sin = context.local_rows(cos, cos.dim() - 2), context.local_rows(sin, sin.dim() - 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if context is None:
            return self._attend(q, k, v, self._mask(q.shape[2], k.shape[2], q))
        if context.algorithm == "ulysses":
            return ulysses_attention(self, self._ulysses_inner, q, k, v, None)[0]
        k, v, mask = gather_kv(self, q, k, v, None, additive=True)
        return self._attend(q, k, v, mask)

    def _ulysses_inner(self, module, q, k, v, mask, **kwargs):
        """The whole sequence of this rank's head group (ulysses' inner call)."""
        return self._attend(q, k, v, self._mask(q.shape[2], k.shape[2], q)), None

    def _mask(self, q_len: int, kv_len: int, q: torch.Tensor) -> torch.Tensor | None:
        return _causal_mask(q_len, kv_len, q.dtype, q.device) if self.config.is_causal else None

    def _attend(self, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        n_rep = q.shape[1] // k.shape[1]
        k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if mask is not None:
            scores = scores + mask
        probs = platform.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = platform.dropout(probs, p=self.config.dropout, training=self.training)
        return torch.matmul(probs, v).transpose(1, 2).contiguous()


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    batch, kv_heads, seq, head_dim = x.shape
    return x[:, :, None, :, :].expand(batch, kv_heads, n_rep, seq, head_dim).reshape(
        batch, kv_heads * n_rep, seq, head_dim)


def _causal_mask(q_len: int, kv_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask: 0 where a query may attend, the dtype's minimum elsewhere."""
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)
    zero = torch.tensor(0.0, dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


class GQAttention(Module):
    """Sub-configs left ``None`` are derived from the dimensions in ``__post_init__``;
    pass them explicitly to change a projection or norm (or its sharding)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        n_heads: int
        n_kv_heads: int
        head_dim: int | None = None
        bias: bool = False
        qk_norm: bool = False
        norm_eps: float = 1e-6
        attn_output_gate: bool = False
        q_proj: Linear.Config | None = None
        k_proj: Linear.Config | None = None
        v_proj: Linear.Config | None = None
        o_proj: Linear.Config | None = None
        q_norm: RMSNorm.Config | None = None
        k_norm: RMSNorm.Config | None = None
        inner_attention: BaseAttention.Config | None = None

        def __post_init__(self) -> None:
            if self.n_heads % self.n_kv_heads:
                raise ValueError(f"GQAttention.Config: n_heads={self.n_heads} is not a multiple "
                                 f"of n_kv_heads={self.n_kv_heads}")
            if self.head_dim is None:
                self.head_dim = self.dim // self.n_heads
            q_width = self.n_heads * self.head_dim * (2 if self.attn_output_gate else 1)
            kv_width = self.n_kv_heads * self.head_dim
            if self.q_proj is None:
                self.q_proj = Linear.Config(in_features=self.dim, out_features=q_width, bias=self.bias)
            if self.k_proj is None:
                self.k_proj = Linear.Config(in_features=self.dim, out_features=kv_width, bias=self.bias)
            if self.v_proj is None:
                self.v_proj = Linear.Config(in_features=self.dim, out_features=kv_width, bias=self.bias)
            if self.o_proj is None:
                self.o_proj = Linear.Config(in_features=self.n_heads * self.head_dim,
                                            out_features=self.dim, bias=self.bias)
            if self.qk_norm and self.q_norm is None:
                self.q_norm = RMSNorm.Config(hidden=self.head_dim, eps=self.norm_eps)
            if self.qk_norm and self.k_norm is None:
                self.k_norm = RMSNorm.Config(hidden=self.head_dim, eps=self.norm_eps)
            if self.inner_attention is None:
                self.inner_attention = BaseAttention.Config(head_dim=self.head_dim)

    def __init__(self, config: "GQAttention.Config"):
        Module.__init__(self, config)
        self.head_dim = config.head_dim
        self.q_proj = config.q_proj.build()
        self.k_proj = config.k_proj.build()
        self.v_proj = config.v_proj.build()
        self.o_proj = config.o_proj.build()
        self.q_norm = config.q_norm.build() if config.qk_norm else None
        self.k_norm = config.k_norm.build() if config.qk_norm else None
        self.inner_attention = config.inner_attention.build()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` [b, s, dim]; ``cos``/``sin`` [b, s, head_dim] from ``RoPE``."""
        input_shape = x.shape[:-1]
        head_shape = (*input_shape, -1, self.head_dim)
        gate = None
        if self.config.attn_output_gate:
            q, gate = torch.chunk(self.q_proj(x).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
            gate = gate.reshape(*input_shape, -1)
            q = q.reshape(head_shape)
        else:
            q = self.q_proj(x).view(head_shape)
        k = self.k_proj(x).view(head_shape)
        v = self.v_proj(x).view(head_shape)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cos, sin)
        out = out.reshape(*input_shape, -1).contiguous()
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)
