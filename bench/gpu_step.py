"""Benchmark (one GPU): the trainer against transformers + Accelerate on the same model, batch
and precision, eager and compiled, measured in the same run.

    python bench/gpu_step.py [--shapes dense,moe] [--modes eager,compiled] [--steps 12] [--json OUT]

Shapes (committed recipes, world 1, so the trainer reuses their committed bundles and plans
nothing at start):

- ``dense``: ``recipes/cuda_1gpu/qwen3_0_6b_1gpu.yaml``, a Qwen3-0.6B-shaped decoder;
- ``moe``: ``recipes/cuda_1gpu/qwen3_moe_2l_1gpu.yaml``, Qwen3-30B-A3B's layer (128 experts,
  top 8) twice.

Both train from a fresh initialization on synthetic batches of 8 x 2048 tokens (micro
batches of 4) with float32 master weights and bfloat16 compute. Ours: ``python -m
torch.distributed.run --nproc_per_node=1 -m hyper_parallel.trainer`` with ``--metrics``,
in a copy of the recipe's folder whose ``training.compile`` and
``training.activation_checkpointing`` say the mode (no checkpointing: the baseline keeps
every activation too). The baseline: ``AutoModelForCausalLM.from_config`` (sdpa attention,
transformers' ``grouped_mm`` experts, the kernel a GPU user of transformers runs),
``Accelerator(mixed_precision="bf16")``, AdamW (torch's default kernels), the same batches;
``torch.compile(model)`` in the compiled mode. Each run is its own process, so its memory
peak is its own.

Per run: tokens/s (median over the steps after ``--warmup``), the CUDA allocator's peak
and MFU where the card's bf16 dense peak is known (H100/H200: 989 TFLOP/s; ``--peak-flops``
overrides) from the trainer's own FLOPs per token (``trainer/observe.flops_per_token``).
``ratio`` = ours over the baseline's tokens/s. Goals (issue 52): eager >= 1.0x, compiled
>= 1.3x of the baseline's eager. Needs CUDA; elsewhere it says so and exits 2.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"dense": "recipes/cuda_1gpu/qwen3_0_6b_1gpu.yaml", "moe": "recipes/cuda_1gpu/qwen3_moe_2l_1gpu.yaml"}
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
GOALS = {"eager": 1.0, "compiled": 1.3}  # ours over the baseline's eager tokens/s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="dense,moe")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--peak-flops", type=float, help="the card's bf16 dense peak, FLOP/s")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--baseline-worker", nargs=2, metavar=("SHAPE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(f"bench/gpu_step.py needs a CUDA GPU (torch {torch.__version__} finds none)", file=sys.stderr)
        return 2
    if args.baseline_worker:
        print(json.dumps(baseline_run(*args.baseline_worker, args.steps, args.warmup)))
        return 0
    name = torch.cuda.get_device_name()
    peak = args.peak_flops or next((flops for card, flops in PEAK_BF16.items() if card in name), None)
    result = {"device": name, "torch": torch.__version__, "peak_flops": peak, "shapes": {}}
    for shape in args.shapes.split(","):
        runs = result["shapes"][shape] = {}
        for mode in args.modes.split(","):
            ours, base = trainer_run(shape, mode, args.steps, args.warmup), _baseline(shape, mode, args)
            for run in (ours, base):
                run["mfu"] = run["tokens_per_s"] * run["flops_per_token"] / peak if peak else None
            runs[mode] = {"ours": ours, "baseline": base, "ratio": ours["tokens_per_s"] / base["tokens_per_s"]}
            print(_line(shape, mode, runs[mode]), flush=True)
            if args.json:  # after every run: a script stopped by its time limit keeps what was measured
                Path(args.json).write_text(json.dumps(result, indent=1))
        if "eager" in runs:
            for mode, goal in GOALS.items():
                if mode in runs:
                    ratio = runs[mode]["ours"]["tokens_per_s"] / runs["eager"]["baseline"]["tokens_per_s"]
                    runs[mode]["goal"] = {"over_baseline_eager": ratio, "at_least": goal, "pass": ratio >= goal}
                    print(f"  {shape} {mode}: {ratio:.2f}x the baseline's eager (goal >= {goal}x): "
                          f"{'PASS' if ratio >= goal else 'FAIL'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def trainer_run(shape: str, mode: str, steps: int, warmup: int) -> dict:
    """The trainer's CLI on a copy of the shape's recipe folder (its committed bundle too)."""
    recipe = REPO / SHAPES[shape]
    with tempfile.TemporaryDirectory(prefix="gpu-step-") as tmp:
        project = Path(tmp)
        shutil.copy(REPO / "dodo.py", project / "dodo.py")
        shutil.copytree(recipe.parent, project / "recipes" / recipe.parent.name)
        data = yaml.safe_load(recipe.read_text())
        model_dir = (recipe.parent / data["model"]["pretrained_model_name_or_path"]).resolve()
        shutil.copytree(model_dir, project / "recipes" / "models" / model_dir.name)
        data["training"].update(steps=steps, compile=mode == "compiled", activation_checkpointing=False)
        copy = project / "recipes" / recipe.parent.name / recipe.name
        copy.write_text(yaml.safe_dump(data, sort_keys=False))
        metrics = project / "metrics.jsonl"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                   "-m", "hyper_parallel.trainer", "--config", str(copy), "--metrics", str(metrics)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"trainer ({shape}, {mode}) failed:\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        flops = _flops_per_token(model_dir, data["training"]["seq_len"])
    steady = [row["tokens_per_s"] for row in rows[warmup:]] or [rows[-1]["tokens_per_s"]]
    return {"tokens_per_s": statistics.median(steady), "peak_memory_bytes": max(rows[-1]["peak_memory_bytes"]),
            "first_step_s": rows[0]["seconds"], "last_loss": rows[-1]["loss"], "flops_per_token": flops}


def _baseline(shape: str, mode: str, args) -> dict:
    command = [sys.executable, __file__, "--baseline-worker", shape, mode, "--steps", str(args.steps),
               "--warmup", str(args.warmup)]
    proc = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    if proc.returncode != 0:
        raise SystemExit(f"baseline ({shape}, {mode}) failed:\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def baseline_run(shape: str, mode: str, steps: int, warmup: int) -> dict:
    """transformers + Accelerate on the shape's model, batches and precision (this process)."""
    import torch
    import transformers
    from accelerate import Accelerator

    from hyper_parallel.config import load_training_config
    from hyper_parallel.trainer.data import global_batch, micro_batches

    config = load_training_config(REPO / SHAPES[shape])
    model_dir = config.folder / config.model.pretrained_model_name_or_path
    hf_config = transformers.AutoConfig.from_pretrained(model_dir)
    hf_config._experts_implementation = "grouped_mm"  # what transformers runs on a GPU
    torch.manual_seed(config.training.seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa",
                                                          dtype=torch.float32)
    accelerator = Accelerator(mixed_precision="bf16")
    opt = config.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=tuple(opt.betas),
                                  weight_decay=opt.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    if mode == "compiled":
        model = torch.compile(model)
    training = config.training
    rates, first = [], None
    for step in range(steps):
        batch = global_batch(step, training, config.dataset, hf_config.vocab_size).to(accelerator.device)
        parts = list(micro_batches(batch, 0, 1, training.micro_batch_size, "baseline"))
        torch.cuda.synchronize()
        start = time.perf_counter()
        for micro in parts:
            loss = model(input_ids=micro, labels=micro).loss / len(parts)
            accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        last = loss.item() * len(parts)
        seconds = time.perf_counter() - start
        first = seconds if first is None else first
        rates.append(batch.numel() / seconds)
    return {"tokens_per_s": statistics.median(rates[warmup:] or rates[-1:]),
            "peak_memory_bytes": int(torch.cuda.max_memory_allocated()), "first_step_s": first,
            "last_loss": last, "flops_per_token": _flops_per_token(model_dir, training.seq_len)}


def _flops_per_token(model_dir: Path, seq_len: int) -> float:
    """The trainer's FLOPs per token, counted on the model built on the meta device."""
    import torch
    import transformers

    from hyper_parallel.trainer.observe import flops_per_token

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
    return flops_per_token(model, seq_len)


def _line(shape: str, mode: str, run: dict) -> str:
    def one(side: dict) -> str:
        mfu = f", MFU {side['mfu']:.1%}" if side.get("mfu") is not None else ""
        return f"{side['tokens_per_s']:,.0f} tok/s{mfu}, peak {side['peak_memory_bytes'] / 2**30:.1f} GiB"

    return f"{shape:5} {mode:8} ours {one(run['ours'])} | transformers+accelerate {one(run['baseline'])} | " \
           f"ratio {run['ratio']:.2f}x"


if __name__ == "__main__":
    sys.exit(main())
