"""Benchmark: ``training.compile`` (each decoder layer through torch.compile) against eager,
through the trainer itself.

    python bench/compile.py [--layouts tp2,dp2] [--steps 12] [--json OUT]

A small Qwen3 decoder (hidden 512, 4 layers, 8 query / 4 KV heads, MLP 1536, vocab 4096;
random init, ``save_pretrained`` in a temp folder) trained by ``python -m
hyper_parallel.trainer`` under torchrun (two CPU ranks, gloo, the hf backend: planned at
start) on synthetic batches of 4 x 512 tokens, per layout: eager, then compiled (inductor,
CPU here; on a GPU machine the same bench times the GPU kernels).

Per run: the median step seconds of the steps after the first ``--warmup`` (the first
step of a compiled run includes the compilation, reported apart as ``first_step_s``) and
the last step's loss. ``time_ratio`` = compiled over eager, per layout, measured in the
same invocation; ``loss_rel`` = |compiled - eager| / eager at the last step (the layouts'
equality with one process is tested in tests/trainer/test_train_equivalence.py).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

LAYOUTS = {"tp2": {"tp_size": 2}, "dp2": {"dp_size": 2}}
HIDDEN, LAYERS, HEADS, KV_HEADS, MLP, VOCAB, SEQ, BATCH = 512, 4, 8, 4, 1536, 4096, 512, 4


def model_folder(folder: Path) -> Path:
    """A randomly initialized Qwen3 saved with ``save_pretrained`` (real tensor names)."""
    import torch
    import transformers

    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
                                      max_position_embeddings=SEQ, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = folder / "model"
    model.save_pretrained(path)
    return path


def recipe(folder: Path, model: Path, layout: str, compiled: bool, steps: int) -> Path:
    data = {
        "model": {"pretrained_model_name_or_path": str(model), "torch_dtype": "float32",
                  "attn_implementation": "sdpa"},
        "accelerator": {"device_type": "cpu", "nproc_per_node": 2, "nnodes": 1, **LAYOUTS[layout]},
        "modeling_backend": "hf",
        "training": {"steps": steps, "global_batch_size": BATCH, "micro_batch_size": BATCH // 2 if layout == "dp2"
                     else BATCH, "seq_len": SEQ, "seed": 0, "compile": compiled},
        "optimizer": {"name": "adamw", "lr": 1.0e-4},
    }
    path = folder / "recipes" / f"{layout}_{'compiled' if compiled else 'eager'}.yaml"
    path.parent.mkdir(exist_ok=True)  # beside no bundle: the project root is the workspace's
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def train(folder: Path, config: Path, warmup: int) -> dict:
    metrics = config.with_suffix(".metrics.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "hyper_parallel.trainer", "--config", str(config), "--metrics", str(metrics)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{config.name}: training failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {"median_step_s": statistics.median(r["seconds"] for r in records[warmup:]),
            "first_step_s": records[0]["seconds"], "last_loss": records[-1]["loss"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="tp2,dp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median (compilation, warm-up)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: unknown {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    if args.steps <= args.warmup:
        parser.error(f"--steps must exceed --warmup ({args.warmup})")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = model_folder(folder)
        for layout in layouts:
            eager = train(folder, recipe(folder, model, layout, False, args.steps), args.warmup)
            compiled = train(folder, recipe(folder, model, layout, True, args.steps), args.warmup)
            results[layout] = {"eager": eager, "compiled": compiled,
                               "time_ratio": compiled["median_step_s"] / eager["median_step_s"],
                               "loss_rel": abs(compiled["last_loss"] - eager["last_loss"]) / eager["last_loss"]}
            print(f"{layout}: step {eager['median_step_s']:.3f} s eager, {compiled['median_step_s']:.3f} s compiled "
                  f"(ratio {results[layout]['time_ratio']:.2f}; first compiled step {compiled['first_step_s']:.1f} s); "
                  f"last loss rel {results[layout]['loss_rel']:.1e}", flush=True)
    summary = {"model": f"Qwen3 hidden {HIDDEN}, {LAYERS} layers, seq {SEQ}, batch {BATCH}", "steps": args.steps,
               "warmup": args.warmup, "layouts": results}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
