"""Numbers a step reads back from its tensors to the host, in one place.

A step reads a few values back: the routed row counts that size the expert kernels and
the expert-parallel all-to-alls, the loss and gradient norm it reports, the memory peaks it
gathers. A rank that runs on fake tensors (``trainer dry-run --fake-tensors``: torch's
``FakeTensorMode``, shapes and dtypes without storage) has no values to read, so each read
here takes the stand-in that rank uses instead: routing spread evenly over the experts or
ranks (the load a balanced router gives, which is what a memory estimate plans for), NaN
for a reported figure. On real tensors each read is one ``tolist()`` / ``item()``, as
before. ``outside_fake_tensors`` runs host-side bookkeeping built from tensors (a device
mesh's rank table) for real while a fake mode is active.
"""

import contextlib
import math

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily


def to_host_list(tensor: torch.Tensor, stand_in: list) -> list:
    """``tensor.tolist()``; ``stand_in`` when ``tensor`` is fake (no values to read)."""
    return list(stand_in) if is_fake(tensor) else tensor.tolist()


def to_host_float(tensor: torch.Tensor) -> float:
    """``tensor.item()`` as a float; NaN when ``tensor`` is fake."""
    return math.nan if is_fake(tensor) else float(tensor.item())


def counts_to_host(counts: torch.Tensor, total: int) -> list[int]:
    """Per-bin counts (a 1-d integer tensor) on the host; when fake, ``total`` spread as
    evenly as integers allow (the first ``total % bins`` bins one more)."""
    bins = counts.shape[0]
    share, extra = divmod(total, bins) if bins else (0, 0)
    return to_host_list(counts, [share + (1 if index < extra else 0) for index in range(bins)])


@contextlib.contextmanager
def outside_fake_tensors():
    """Real tensors inside, whatever fake mode is active (torch's own switch)."""
    with unset_fake_temporarily():
        yield
