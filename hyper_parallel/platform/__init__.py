"""Backend indirection: ``from hyper_parallel import platform`` then ``platform.Linear``.

Only torch exists today; the names exported here are the contract another backend
would have to provide.
"""

from hyper_parallel.platform.torch_backend import (
    Embedding,
    Linear,
    Module,
    ModuleList,
    Parameter,
    dropout,
    init,
    linear,
    one_hot,
    silu,
    softmax,
)

__all__ = [
    "Embedding",
    "Linear",
    "Module",
    "ModuleList",
    "Parameter",
    "dropout",
    "init",
    "linear",
    "one_hot",
    "silu",
    "softmax",
]
