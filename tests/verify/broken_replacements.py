"""A replace_module factory that returns a module of the wrong shape (recipes name it
by dotted path): verify must refuse the bundle before it is installed."""

from torch import nn


def wider_o_proj(module: nn.Linear, **kwargs) -> nn.Linear:
    return nn.Linear(module.in_features, module.out_features * 2, bias=module.bias is not None)


def stop_rank_1(module, **kwargs):
    """Leaves the module as it is; on rank 1 of a launched worker whose script name holds
    ``$HP_TEST_STOP_RANK_1`` (``verify_worker``, ``preflight_worker``) it stops its own
    process (SIGSTOP), as a hung or frozen rank would: the others must give up and name it."""
    import os
    import signal
    import sys

    which = os.environ.get("HP_TEST_STOP_RANK_1")
    if which and which in sys.argv[0] and os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RUN_ID"):
        os.kill(os.getpid(), signal.SIGSTOP)
    return module
