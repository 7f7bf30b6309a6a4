"""The context-parallel exchanges on gloo free what they sent once they are waited for:
the all-gather sends cp copies of the local K/V (as large as the gathered result) and the
reduce-scatter the whole sequence's gradients; a finished exchange held them for as long
as its wait function lived (the attention's whole backward). One gloo rank in a fresh
process (no process group is left in the test's)."""

import subprocess
import sys

SCRIPT = """
import gc, weakref
import torch, torch.distributed as dist
from hyper_parallel.distributed import context_parallel as cp
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
sent = []
original = dist.all_to_all_single
dist.all_to_all_single = lambda out, inp, *a, **k: (sent.append(weakref.ref(inp)), original(out, inp, *a, **k))[1]
gathered = cp._all_gather_async(torch.randn(2, 1, 2, 64, 8), dist.group.WORLD)
pieces = gathered()
summed = cp._reduce_scatter_async(torch.randn(2, 1, 2, 64, 8), dist.group.WORLD, 3)
piece = summed()
gc.collect()
print([ref() is None for ref in sent], len(pieces), tuple(piece.shape))
dist.destroy_process_group()
"""


def test_a_waited_exchange_holds_nothing_it_sent():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[True, True] 1 (2, 1, 2, 64, 8)", proc.stdout
