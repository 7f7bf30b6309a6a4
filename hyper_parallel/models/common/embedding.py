"""Embedding: the backend's embedding table, built from a Config."""

from dataclasses import dataclass, field

from hyper_parallel import platform
from hyper_parallel.models.common.param_init import normal_
from hyper_parallel.protocols import Function, Module


class Embedding(platform.Embedding, Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        num_embeddings: int
        embedding_dim: int
        padding_idx: int | None = None
        _param_init: Function.Config = field(default_factory=lambda: Function.Config(fn=normal_))

    def __init__(self, config: "Embedding.Config"):
        platform.Embedding.__init__(
            self, config.num_embeddings, config.embedding_dim, padding_idx=config.padding_idx)
        Module.__init__(self, config)

    def _init_self_params(self) -> None:
        self.config._param_init(self.weight)
        if self.padding_idx is not None:
            self.weight[self.padding_idx].zero_()
