"""FeedForward: SwiGLU, ``w2(silu(w1(x)) * w3(x))`` (HF's gate_proj / down_proj / up_proj
are w1 / w2 / w3)."""

from dataclasses import dataclass

import torch

from hyper_parallel import platform
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.protocols import Module


class FeedForward(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        hidden_dim: int
        bias: bool = False
        w1: Linear.Config | None = None
        w2: Linear.Config | None = None
        w3: Linear.Config | None = None

        def __post_init__(self) -> None:
            if self.w1 is None:
                self.w1 = Linear.Config(in_features=self.dim, out_features=self.hidden_dim, bias=self.bias)
            if self.w2 is None:
                self.w2 = Linear.Config(in_features=self.hidden_dim, out_features=self.dim, bias=self.bias)
            if self.w3 is None:
                self.w3 = Linear.Config(in_features=self.dim, out_features=self.hidden_dim, bias=self.bias)

    def __init__(self, config: "FeedForward.Config"):
        Module.__init__(self, config)
        self.w1 = config.w1.build()
        self.w2 = config.w2.build()
        self.w3 = config.w3.build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(platform.silu(self.w1(x)) * self.w3(x))
