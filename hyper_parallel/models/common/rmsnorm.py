"""RMS normalization over the last dimension.

- ``RMSNorm``: ``w * normed`` with ``w`` starting at one; the input is normalized in
  fp32 and cast back before the weight multiplies (HF Qwen3MoeRMSNorm's order).
- ``Qwen3_5RMSNorm``: ``(1 + w) * normed`` with ``w`` starting at zero, all in fp32 and
  cast back last (HF Qwen3_5RMSNorm). Qwen3.5 checkpoints store ``w`` this way, so the
  two cannot share one formula.
"""

from dataclasses import dataclass, field

import torch

from hyper_parallel import platform
from hyper_parallel.models.common.param_init import ones_, zeros_
from hyper_parallel.protocols import Function, Module


class RMSNorm(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        hidden: int
        eps: float = 1e-6
        _param_init: Function.Config = field(default_factory=lambda: Function.Config(fn=ones_))

    def __init__(self, config: "RMSNorm.Config"):
        Module.__init__(self, config)
        self.eps = config.eps
        self.weight = platform.Parameter(torch.ones(config.hidden))

    def _normalize_fp32(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self._normalize_fp32(x).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class Qwen3_5RMSNorm(RMSNorm):
    @dataclass(kw_only=True, slots=True)
    class Config(RMSNorm.Config):
        _param_init: Function.Config = field(default_factory=lambda: Function.Config(fn=zeros_))

    def __init__(self, config: "Qwen3_5RMSNorm.Config"):
        RMSNorm.__init__(self, config)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self._normalize_fp32(x) * (1.0 + self.weight.float())).type_as(x)
