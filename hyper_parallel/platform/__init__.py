"""Backend indirection: ``from hyper_parallel import platform`` then ``platform.Linear``.

Only torch exists today; the names exported here are the contract another backend
would have to provide.
"""

from hyper_parallel.platform.torch_backend import (
    Embedding,
    Linear,
    Module,
    ModuleDict,
    ModuleList,
    Parameter,
    cross_entropy,
    device_type,
    dist_backend,
    dropout,
    embedding,
    init,
    linear,
    one_hot,
    silu,
    softmax,
)

BACKEND = "torch"

__all__ = [
    "BACKEND",
    "Embedding",
    "Linear",
    "Module",
    "ModuleDict",
    "ModuleList",
    "Parameter",
    "cross_entropy",
    "device_type",
    "dist_backend",
    "dropout",
    "embedding",
    "init",
    "linear",
    "one_hot",
    "silu",
    "softmax",
]
