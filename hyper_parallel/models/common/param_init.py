"""Parameter initializers, module-level so that ``Function.Config(fn=...)`` can hold and
serialize them. Each forwards to the backend's initializer with the same defaults."""

import math

from hyper_parallel import platform


def kaiming_uniform_(tensor, *, a: float = math.sqrt(5), mode: str = "fan_in",
                     nonlinearity: str = "leaky_relu"):
    # a = sqrt(5) is what the backend's Linear uses, so a fresh init matches nn.Linear's.
    return platform.init.kaiming_uniform_(tensor, a=a, mode=mode, nonlinearity=nonlinearity)


def xavier_normal_(tensor, *, gain: float = 1.0):
    return platform.init.xavier_normal_(tensor, gain=gain)


def normal_(tensor, *, mean: float = 0.0, std: float = 1.0):
    return platform.init.normal_(tensor, mean=mean, std=std)


def zeros_(tensor):
    return platform.init.zeros_(tensor)


def ones_(tensor):
    return platform.init.ones_(tensor)
