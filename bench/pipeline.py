"""Pipeline parallel: the measured bubble of each schedule against the theory, and each
stage's activation memory against one process.

    python bench/pipeline.py --json /tmp/pp.json              # pp2 and pp4, GPipe and 1F1B, m = 8
    python bench/pipeline.py --microbatches 4 --layer-ms 10    # quicker

The model is a tiny Llama (8 decoder layers, hidden 64) split by the project's own
pipeline code (``distributed/pipeline.py``: ``prune_to_stage``, ``build_schedule``) and run by
torch's schedules under torchrun (gloo, CPU). Each decoder layer's work is simulated: its
forward sleeps ``--layer-ms`` and its backward twice that (hooks on the layer), so the
layers' real arithmetic (microseconds at this size) is noise and ``pp`` ranks share a small
machine's cores without slowing each other; what is measured is the schedule itself.

Per schedule and pp, the median over ``--steps`` steps (after one warm-up step) of

- ``bubble``: per stage, 1 - (the step's simulated layer time on that stage) / (the
  step's wall time), and its mean over the stages, against the theoretical
  ``(p - 1) / (m + p - 1)`` for ``m`` micro-batches (both schedules; 1F1B's gain is memory);
- ``activation_peak_ratio``: per stage, the largest bytes of tensors autograd held for
  backward at once during a step (every saved tensor counted while its graph lives, the
  weights left out), over the same for the whole model in one process running the ``m``
  micro-batches one after another (gradient accumulation). Theory: GPipe m/p (every
  micro-batch's activations of 1/p of the layers), 1F1B (p - s)/p on stage s.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

LAYERS, HIDDEN, VOCAB, SEQ, ROWS_PER_MICROBATCH = 8, 64, 128, 32, 2


def _model():
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=SEQ, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)


class LayerWork:
    """Sleeps standing in for each decoder layer's forward and backward; ``busy`` adds up
    the time spent in them."""

    def __init__(self, forward_s: float):
        self.forward_s, self.busy = forward_s, 0.0

    def _sleep(self, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.busy += time.perf_counter() - start

    def install(self, layer) -> None:
        layer.register_forward_pre_hook(lambda module, args: self._sleep(self.forward_s))
        layer.register_full_backward_pre_hook(lambda module, grad_output: self._sleep(2 * self.forward_s))


class SavedBytes:
    """The bytes of tensors autograd holds for backward, live and at their peak (each
    saved tensor counted from its pack until the graph holding it is freed)."""

    def __init__(self, weights):
        self.live = self.peak = 0
        self.weights = {t.data_ptr() for t in weights}

    def pack(self, tensor):
        holder = _Saved(tensor)
        if tensor.data_ptr() not in self.weights:
            size = tensor.numel() * tensor.element_size()
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(holder, self._free, size)
        return holder

    def _free(self, size: int) -> None:
        self.live -= size

    @staticmethod
    def unpack(holder):
        return holder.tensor


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def run_rank(args) -> None:
    """One rank of a pipeline run: its stage's bubble and saved bytes per step."""
    import torch
    import torch.distributed as dist

    from hyper_parallel.config.pipeline import PipelineSettings, stage_split
    from hyper_parallel.distributed.pipeline import build_schedule, decoder_layer_weights, prune_to_stage

    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    model = _model().train()
    boundaries = stage_split(PipelineSettings(args.schedule), pp, decoder_layer_weights(model))
    info = prune_to_stage(model, boundaries, (rank,))
    work = LayerWork(args.layer_ms / 1000)
    for position in info.layers:
        work.install(model.model.layers[position])
    schedule = build_schedule(model, schedule=args.schedule, microbatches=args.microbatches,
                              pp_group=dist.group.WORLD, device=torch.device("cpu"))
    rows = torch.randint(0, VOCAB, (args.microbatches * ROWS_PER_MICROBATCH, SEQ),
                         generator=torch.Generator().manual_seed(1))
    saved = SavedBytes(model.parameters())
    steps = []
    for step in range(args.steps + 1):
        work.busy, saved.peak = 0.0, saved.live
        dist.barrier()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            schedule.step(*((rows,) if info.is_first else ()), target=rows if info.is_last else None,
                          losses=[] if info.is_last else None, return_outputs=False)
        wall = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        if step:  # the first step is a warm-up (shape inference, first allocations)
            steps.append({"wall_s": wall, "busy_s": work.busy, "saved_peak_bytes": saved.peak})
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"stage": rank, "layers": info.layers,
                                                               "steps": steps}))
    dist.barrier()
    dist.destroy_process_group()


def one_process_peak(microbatches: int) -> int:
    """The whole model in one process, ``microbatches`` accumulated one after another:
    the peak of saved bytes (one micro-batch's activations of every layer)."""
    import torch

    model = _model().train()
    saved = SavedBytes(model.parameters())
    rows = torch.randint(0, VOCAB, (microbatches * ROWS_PER_MICROBATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        for micro in rows.split(ROWS_PER_MICROBATCH):
            (model(input_ids=micro, labels=micro).loss / microbatches).backward()
    return saved.peak


def measure(schedule: str, pp: int, args) -> dict:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={pp}",
                   __file__, "--rank-worker", "--schedule", schedule, "--microbatches", str(args.microbatches),
                   "--layer-ms", str(args.layer_ms), "--steps", str(args.steps), "--out", out]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode:
            raise SystemExit(f"pipeline run {schedule} pp{pp} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        ranks = [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(pp)]
    m = args.microbatches
    bubbles = [statistics.median(1 - s["busy_s"] / s["wall_s"] for s in rank["steps"]) for rank in ranks]
    peaks = [max(s["saved_peak_bytes"] for s in rank["steps"]) for rank in ranks]
    return {"schedule": schedule, "pp": pp, "microbatches": m,
            "bubble_per_stage": [round(b, 4) for b in bubbles], "bubble": round(statistics.mean(bubbles), 4),
            "bubble_theory": round((pp - 1) / (m + pp - 1), 4),
            "step_s": round(statistics.median(statistics.median(s["wall_s"] for s in r["steps"]) for r in ranks), 4),
            "saved_peak_bytes_per_stage": peaks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layer-ms", type=float, default=20.0, help="simulated forward time per layer (ms)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run (after one warm-up)")
    parser.add_argument("--pp", default="2,4", help="comma-separated pipeline sizes")
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        run_rank(args)
        return
    baseline = one_process_peak(args.microbatches)
    rows = []
    for pp in (int(p) for p in args.pp.split(",")):
        for schedule in args.schedules.split(","):
            row = measure(schedule, pp, args)
            row["activation_peak_ratio"] = [round(peak / baseline, 3) for peak in row["saved_peak_bytes_per_stage"]]
            # every micro-batch in flight (GPipe) or p - s of them (1F1B), each of 1/p of the layers
            row["activation_peak_ratio_theory"] = [round((args.microbatches if schedule == "gpipe" else pp - stage) / pp,
                                                         3) for stage in range(pp)]
            rows.append(row)
            print(f"{schedule:6s} pp{pp} m={row['microbatches']}: bubble {row['bubble']:.3f} "
                  f"(theory {row['bubble_theory']:.3f}; per stage {row['bubble_per_stage']}), "
                  f"step {row['step_s']:.3f}s, activation peak per stage vs pp1 {row['activation_peak_ratio']} "
                  f"(theory {row['activation_peak_ratio_theory']})",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"pp1_saved_peak_bytes": baseline, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
