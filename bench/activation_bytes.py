"""One forward and backward of a piece of a model, timed, with the bytes its forward saved
for backward: autograd's saved tensors, unique storages, the model's weights left out (the
activation memory of that piece; CPU has no allocator peak to read). Shared by the benches
that compare a layer's memory across layouts (``context_parallel.py``, ``hybrid_layer.py``)."""

import time


def step_runner(model, forward):
    """A function running ``forward()`` (returning the piece's output) then the backward of
    its sum; it returns the seconds and the saved bytes, and clears the gradients after (as
    the optimizer's zero_grad: the next backward stores its gradients, it does not add)."""
    import torch

    weights = {local(p).untyped_storage().data_ptr() for p in model.parameters()}

    def run() -> tuple[float, int]:
        storages: dict[int, int] = {}

        def pack(tensor):
            storage = local(tensor).untyped_storage()
            if storage.data_ptr() not in weights:
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = forward()
        out.sum().backward()
        elapsed = time.perf_counter() - start
        for parameter in model.parameters():
            parameter.grad = None
        return elapsed, sum(storages.values())

    return run


def local(tensor):
    """A DTensor's local shard (whose storage is the memory), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def take_turns(runners: dict, repeats: int) -> dict[str, dict]:
    """Run every mode's runner ``repeats`` times, round-robin after a warm-up round, all
    ranks on the same mode at once: a drift in the machine's speed (a shared host) falls on
    every mode alike instead of on whichever ran during it. Per mode: the median seconds and
    the saved bytes."""
    import statistics

    import torch.distributed as dist

    seconds: dict[str, list[float]] = {name: [] for name in runners}
    saved: dict[str, int] = {}
    for repeat in range(repeats + 1):
        for name, run in runners.items():
            dist.barrier()
            elapsed, saved[name] = run()
            if repeat:
                seconds[name].append(elapsed)
    return {name: {"seconds": statistics.median(seconds[name]), "saved_bytes": saved[name]} for name in runners}


def rank_mesh(dims):
    """This torchrun rank's mesh context for ``dims`` (one CPU thread per rank, as the
    benches measure) and its rank."""
    import torch
    import torch.distributed as dist

    from hyper_parallel.config.layout import Layout
    from hyper_parallel.distributed.mesh import MeshContext, build_device_mesh

    torch.set_num_threads(1)
    return MeshContext(build_device_mesh(dims, "cpu"), Layout(dims)), dist.get_rank()


def run_ranks(script: str, flags: list[str], env: dict | None = None, ranks: int = 2) -> list[dict]:
    """Run ``script --worker --out DIR FLAGS`` as ``ranks`` torchrun ranks (one thread each,
    ``env`` on top) and read back what each rank wrote to ``DIR/rank<N>.json``."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                   script, "--worker", "--out", out, *flags]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=3600)
        return [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(ranks)]
