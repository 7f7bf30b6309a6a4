"""Mixture of experts: ``Router`` (softmax top-k), ``Experts`` (SwiGLU per expert, HF's
fused layout), ``MoE`` (router + experts) and ``SharedExpertMoE`` (plus a gated shared
expert).

Parameter layouts are HF's (Qwen3MoeTopKRouter / Qwen3MoeExperts) so that checkpoints
load without reshaping: ``router.weight`` [experts, dim], ``experts.gate_up_proj``
[experts, 2·hidden, dim] (gate rows, then up rows), ``experts.down_proj``
[experts, dim, hidden]. ``Experts.forward`` is HF's eager per-expert loop, op for op.
"""

from dataclasses import dataclass, field

import torch

from hyper_parallel import platform
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.param_init import normal_
from hyper_parallel.protocols import Function, Module


def _small_normal() -> Function.Config:
    return Function.Config(fn=normal_, kwargs={"std": 0.02})


class Router(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        num_experts: int
        top_k: int
        norm_topk_prob: bool = True
        _param_init: Function.Config = field(default_factory=_small_normal)

    def __init__(self, config: "Router.Config"):
        Module.__init__(self, config)
        self.weight = platform.Parameter(torch.zeros(config.num_experts, config.dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [tokens, dim] → (logits [tokens, experts], top-k weights, top-k expert ids)."""
        x = x.reshape(-1, self.config.dim)
        logits = platform.linear(x, self.weight)
        probs = platform.softmax(logits, dtype=torch.float, dim=-1)
        top_weights, top_ids = torch.topk(probs, self.config.top_k, dim=-1)
        if self.config.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return logits, top_weights.to(logits.dtype), top_ids


class Experts(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        hidden_dim: int
        num_experts: int
        _param_init: Function.Config = field(default_factory=_small_normal)

    def __init__(self, config: "Experts.Config"):
        Module.__init__(self, config)
        self.gate_up_proj = platform.Parameter(
            torch.empty(config.num_experts, 2 * config.hidden_dim, config.dim))
        self.down_proj = platform.Parameter(torch.empty(config.num_experts, config.dim, config.hidden_dim))
        # the experts this module computes: expert parallel's dispatch sets the local count
        # while it runs the module on the tokens sent to this rank (HF's experts interface)
        self.num_experts = config.num_experts

    def forward(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        """``x`` [tokens, dim]; ``top_ids`` / ``top_weights`` [tokens, k] → [tokens, dim]."""
        num_experts = self.num_experts
        out = torch.zeros_like(x)
        with torch.no_grad():
            # [experts + 1, k, tokens]; the extra class absorbs out-of-range ids (dropped tokens)
            expert_mask = platform.one_hot(top_ids, num_classes=num_experts + 1).permute(2, 1, 0)
            experts_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert in experts_hit:
            expert = expert[0]
            if expert == num_experts:
                continue
            slot, token = torch.where(expert_mask[expert])
            gate, up = platform.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = platform.linear(platform.silu(gate) * up, self.down_proj[expert])
            y = y * top_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class MoE(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        hidden_dim: int
        num_experts: int
        top_k: int
        norm_topk_prob: bool = True
        router: Router.Config | None = None
        experts: Experts.Config | None = None

        def __post_init__(self) -> None:
            if self.router is None:
                self.router = Router.Config(dim=self.dim, num_experts=self.num_experts, top_k=self.top_k,
                                            norm_topk_prob=self.norm_topk_prob)
            if self.experts is None:
                self.experts = Experts.Config(dim=self.dim, hidden_dim=self.hidden_dim,
                                              num_experts=self.num_experts)

    def __init__(self, config: "MoE.Config"):
        Module.__init__(self, config)
        self.router = config.router.build()
        self.experts = config.experts.build()

    def _routed(self, tokens: torch.Tensor) -> torch.Tensor:
        _, top_weights, top_ids = self.router(tokens)
        return self.experts(tokens, top_ids, top_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        return self._routed(x.view(-1, dim)).reshape(batch, seq, dim)


class SharedExpertMoE(MoE):
    """MoE plus a dense shared expert scaled by ``sigmoid(shared_expert_gate(x))``
    (HF Qwen2-MoE / Qwen3.5-MoE)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MoE.Config):
        shared_hidden_dim: int
        shared_expert: FeedForward.Config | None = None
        shared_expert_gate: Linear.Config | None = None

        def __post_init__(self) -> None:
            MoE.Config.__post_init__(self)
            if self.shared_expert is None:
                self.shared_expert = FeedForward.Config(dim=self.dim, hidden_dim=self.shared_hidden_dim)
            if self.shared_expert_gate is None:
                self.shared_expert_gate = Linear.Config(in_features=self.dim, out_features=1, bias=False)

    def __init__(self, config: "SharedExpertMoE.Config"):
        MoE.__init__(self, config)
        self.shared_expert = config.shared_expert.build()
        self.shared_expert_gate = config.shared_expert_gate.build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.view(-1, dim)
        shared = self.shared_expert(tokens)
        routed = self._routed(tokens)
        shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
        return (routed + shared).reshape(batch, seq, dim)
