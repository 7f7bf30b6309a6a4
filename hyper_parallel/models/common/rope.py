"""Rotary position embedding (default RoPE, as HF Qwen3MoeRotaryEmbedding).

The cos/sin tables for positions ``0 .. max_seq_len-1`` are non-persistent buffers
derived from the config; ``_init_self_buffers`` (run by ``init_states``) recomputes them,
so a model built on the meta device gets them back on ``buffer_device``. They are
computed with the reference's exact sequence of ops, so a lookup equals the reference's
per-call computation bit for bit.
"""

from dataclasses import dataclass
from typing import Any

import torch

from hyper_parallel.protocols import Module


class RoPE(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        head_dim: int
        max_seq_len: int
        theta: float = 10000.0

    def __init__(self, config: "RoPE.Config"):
        Module.__init__(self, config)
        if config.head_dim % 2:
            raise ValueError(f"RoPE.Config.head_dim must be even, got {config.head_dim}")
        self.register_buffer("inv_freq", torch.empty(config.head_dim // 2), persistent=False)
        self.register_buffer("cos_cache", torch.empty(config.max_seq_len, config.head_dim), persistent=False)
        self.register_buffer("sin_cache", torch.empty(config.max_seq_len, config.head_dim), persistent=False)
        self._init_self_buffers(None)

    def _init_self_buffers(self, buffer_device: Any) -> None:
        device = buffer_device if buffer_device is not None else self.inv_freq.device
        if torch.device(device).type == "meta":
            return
        cfg = self.config
        inv_freq = 1.0 / (cfg.theta ** (
            torch.arange(0, cfg.head_dim, 2, dtype=torch.float, device=device)
            / cfg.head_dim))
        positions = torch.arange(cfg.max_seq_len, device=device).float()
        freqs = positions[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        self.inv_freq = inv_freq
        self.cos_cache = emb.cos()
        self.sin_cache = emb.sin()

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` for ``position_ids`` ([batch, seq] → [batch, seq, head_dim]) in ``x``'s dtype.

        ``head_dim`` here is the rotated width: the attention's head_dim, or less for
        partial rotary."""
        if position_ids.max() >= self.config.max_seq_len:
            raise ValueError(
                f"RoPE: position {int(position_ids.max())} is beyond max_seq_len={self.config.max_seq_len}")
        return self.cos_cache[position_ids].to(x.dtype), self.sin_cache[position_ids].to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q``/``k`` ([batch, heads, seq, head_dim]) by ``cos``/``sin`` ([batch, seq, rotary_dim]).

    With ``rotary_dim < head_dim`` (partial rotary, Qwen3.5) only the leading
    ``rotary_dim`` channels rotate and the rest pass through, concatenated back as HF
    Qwen3.5 does; with the full width it is HF Qwen3-MoE's formula (no concatenation,
    which also keeps the input's memory layout, and matmul rounding depends on it).
    """
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    if rotary_dim == q.shape[-1]:
        return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)
