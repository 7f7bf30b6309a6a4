"""The torch backend: module classes, functional ops and parameter initializers.

Everything the model components need from the framework is named here once, so that
``models/common`` never imports ``torch.nn`` directly and another backend (mindspore)
can provide the same names.
"""

import torch
import torch.nn.functional as functional
from torch import nn

Module = nn.Module
ModuleList = nn.ModuleList
ModuleDict = nn.ModuleDict
Linear = nn.Linear
Embedding = nn.Embedding
Parameter = nn.Parameter

init = nn.init

linear = functional.linear
embedding = functional.embedding
silu = functional.silu
softmax = functional.softmax
dropout = functional.dropout
one_hot = functional.one_hot
cross_entropy = functional.cross_entropy

_DIST_BACKEND_BY_DEVICE = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


def device_type() -> str:
    """The accelerator present on this host: npu, then cuda, else cpu."""
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def dist_backend(device: str) -> str:
    """The collective backend for a device type (npu → hccl, cuda → nccl, cpu → gloo)."""
    try:
        return _DIST_BACKEND_BY_DEVICE[device]
    except KeyError:
        raise ValueError(
            f"unknown device type {device!r}; expected one of {', '.join(_DIST_BACKEND_BY_DEVICE)}") from None
