"""The torch backend: module classes, functional ops and parameter initializers.

Everything the model components need from the framework is named here once, so that
``models/common`` never imports ``torch.nn`` directly and another backend (mindspore)
can provide the same names.
"""

import torch.nn.functional as functional
from torch import nn

Module = nn.Module
ModuleList = nn.ModuleList
Linear = nn.Linear
Embedding = nn.Embedding
Parameter = nn.Parameter

init = nn.init

linear = functional.linear
silu = functional.silu
softmax = functional.softmax
dropout = functional.dropout
one_hot = functional.one_hot
