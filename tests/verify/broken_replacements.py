"""A replace_module factory that returns a module of the wrong shape (recipes name it
by dotted path): verify must refuse the bundle before it is installed."""

from torch import nn


def wider_o_proj(module: nn.Linear, **kwargs) -> nn.Linear:
    return nn.Linear(module.in_features, module.out_features * 2, bias=module.bias is not None)
