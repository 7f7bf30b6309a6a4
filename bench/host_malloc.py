"""glibc malloc settings the CPU benches run under, so that a step measures its own work.

glibc serves each large buffer with its own mmap and unmaps it when freed, so every step
faults its megabytes in again (the kernel zeroes each 4 KiB page on first write); how long
that takes swings with the host (measured here: the same attention mode 0.16 s or 0.30 s
from one run to the next; the same grouped-experts step 1.4 s or 2.2 s). Keeping freed
memory in the heap, as jemalloc / tcmalloc or these settings do in training, leaves each
implementation's own cost to be measured, the same for every mode. The settings are read
when the process starts, so they go into a child's environment (``run_ranks``) or the
bench starts itself again with them (``restart_keeping_freed_memory``).
"""

import os
import sys

KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


def restart_keeping_freed_memory() -> None:
    """Start this script again (same interpreter and arguments) with ``KEEP_FREED_MEMORY``
    in its environment, unless it already runs with them."""
    if all(os.environ.get(name) == value for name, value in KEEP_FREED_MEMORY.items()):
        return
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **KEEP_FREED_MEMORY})
