"""Where this process stands among the ranks: whether a process group of several ranks is
up, and which node this rank runs on. Torch is imported only when asked (the codegen
manager and the bundle's integrity check import this torch-free)."""

import os

# How long a rank other than 0 waits, by default, for rank 0 to build or reuse the recipe's
# bundle: read by the build tool (codegen/manager.py) and by its door (runtime/build.py).
BUNDLE_WAIT_TIMEOUT_S = 600.0


def group_of_several_ranks() -> bool:
    """A process group of more than one rank is up (training under torchrun): the ranks
    can, and must, agree through collectives. Not in a fake world (``fake_world``): there
    this rank is alone, and what it would agree on with others (bundle bytes, verdicts,
    cache fingerprints) it takes from its own disk as a single process does."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and not fake_world()


def fake_world() -> bool:
    """This rank runs alone on torch's fake process group (``trainer dry-run``): its
    collectives hand back what they were given, nothing crosses to another rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake"


def node_of_this_rank() -> str:
    """The node this process runs on, as torchrun numbers it (``GROUP_RANK``), else its
    host name: what a failure names beside the ranks."""
    node = os.environ.get("GROUP_RANK")
    return f"node {node}" if node is not None else f"host {os.uname().nodename}"
