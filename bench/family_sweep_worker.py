"""torchrun worker (world 2) for bench/family_sweep.py's peer column.

    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/family_sweep_worker.py \
        --cases CASES.json --out OUT_DIR

CASES.json is a list of ``{"family", "model_dir"}``. For each, in order: transformers' own
tensor parallel (``from_pretrained(model_dir, tp_plan="auto")``) and the single-process model
from the same checkpoint train STEPS AdamW steps on the same tokens (training mode, the global random state seeded alike at each step), and the single-process model
again with rounding noise on its gradients (the judge's noise floor, as for the gen backend's
rows); each rank writes ``OUT_DIR/<family>.rank<N>.json`` with the runs' per-step loss and global gradient norm
(sharded gradients gathered). ``OUT_DIR/<family>.started`` marks the case in progress, so a
launcher can tell which case a crashed or hung launch was on. A case that raises records its
error and ends the launch (a failed collective can leave the process group unusable); the
launcher starts a new one for the cases left.
"""

import argparse
import datetime
import json
import math
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

from hyper_parallel.trainer.reference import add_rounding_noise

STEPS, LR, BATCH, SEQ, SEED = 3, 1e-3, 2, 16, 5


def load(model_dir: str, **kwargs):
    """The checkpoint as transformers loads it (eager attention, fp32)."""
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                                             dtype=torch.float32, **kwargs)


def global_grad_norm(model, full_shapes: dict[str, tuple]) -> float:
    """The whole model's gradient norm: DTensor gradients gathered; a plain tensor smaller
    than the unsharded parameter is this rank's shard (squares summed over ranks); one of
    the full shape is a replica (counted once)."""
    replicated = torch.zeros((), dtype=torch.float64)
    sharded = torch.zeros((), dtype=torch.float64)
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            replicated += grad.full_tensor().double().pow(2).sum()
        elif tuple(grad.shape) != full_shapes[name]:
            sharded += grad.double().pow(2).sum()
        else:
            replicated += grad.double().pow(2).sum()
    dist.all_reduce(sharded)
    return math.sqrt((replicated + sharded).item())


def train(model, batch, full_shapes: dict[str, tuple], rounding_noise: bool = False) -> list[dict]:
    """Loss and gradient norm before each of STEPS AdamW steps (with ``rounding_noise``, the
    gradients perturbed after each record: the judge's measure of AdamW's own noise)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    records, generator = [], torch.Generator().manual_seed(0)
    model.train()  # as training runs it (PhiMoE samples its experts only in training)
    for step in range(STEPS):
        torch.manual_seed(SEED + step)  # the same draws for every model and rank at a step
        loss = model(input_ids=batch, labels=batch).loss
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        loss.backward()
        records.append({"loss": value.item(), "grad_norm": global_grad_norm(model, full_shapes)})
        if rounding_noise:
            add_rounding_noise(model.parameters(), generator)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return records


def run_case(case: dict) -> dict:
    """Peer and reference on one checkpoint; what the peer sharded."""
    reference = load(case["model_dir"])
    full_shapes = {name: tuple(p.shape) for name, p in reference.named_parameters()}
    peer = load(case["model_dir"], tp_plan="auto")
    sharded = sorted(name for name, p in peer.named_parameters()
                     if (isinstance(p, DTensor) and any(not pl.is_replicate() for pl in p.placements))
                     or tuple(p.shape) != full_shapes.get(name))
    batch = torch.randint(0, reference.config.vocab_size, (BATCH, SEQ),
                          generator=torch.Generator().manual_seed(SEED))
    return {"tp_size": getattr(peer, "tp_size", None), "sharded": sharded,
            "reference": train(reference, batch, full_shapes), "peer": train(peer, batch, full_shapes),
            "reference_noisy": train(load(case["model_dir"]), batch, full_shapes, rounding_noise=True)}


def leave(code: int) -> None:
    """Leave without process-group teardown (it now and then aborts a finished rank)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    out = Path(args.out)
    for case in json.loads(Path(args.cases).read_text()):
        if rank == 0:
            (out / f"{case['family']}.started").write_text("")
        try:
            result = run_case(case)
        except Exception as exc:  # recorded; the launch ends (see the module docstring)
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        (out / f"{case['family']}.rank{rank}.json").write_text(json.dumps(result, indent=1))
        if "error" in result:
            leave(3)
        dist.barrier()
    dist.barrier()
    leave(0)


if __name__ == "__main__":
    main()
