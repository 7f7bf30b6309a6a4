"""Benchmark (issue 28): mixed precision against float32 and pure bf16 training, through
the trainer itself on real text.

    python bench/mixed_precision.py [--steps 200] [--quick] [--json OUT]

A ~96M-parameter Qwen3 decoder (hidden 768, 12 layers, 12 query / 4 KV heads, MLP 2304,
vocab 8192, untied head; random init, ``save_pretrained`` in a temp folder) with a BPE
tokenizer trained on the corpus: the Python standard library's own sources (``*.py`` under
the interpreter's ``lib`` folder, one document per file, ``dataset.kind: text``). Three
runs of ``python -m hyper_parallel.trainer`` (torchrun, one CPU rank, the hf backend) on the
same weights and data, and a fourth for the noise floor:

- fp32: ``model.torch_dtype: float32`` (the baseline);
- mixed: ``model.torch_dtype: bfloat16`` with the default ``training.mixed_precision``
  (float32 master weights and AdamW state, bf16 compute by autocast, float32 reduction);
- bf16: ``model.torch_dtype: bfloat16`` and ``mixed_precision: none`` (everything bf16);
- fp32_seed1: fp32 again with ``training.seed: 1`` (the training rows in another order):
  the noise floor, how far the final loss moves for a change that is not numerical.

Every run warms the learning rate up linearly (``--warmup`` steps) and decays it by cosine
to a tenth, as real runs do (a constant rate leaves the final loss wandering).

Per run: the median step seconds (the first three steps left out: warm-up), the peak RSS
(the metrics file's ``peak_memory_bytes``), and the final loss: ``training.eval``'s loss
after the last step on ``--eval-batches`` held-out batches (rows drawn at random over the
corpus, the same for every run, never trained on; one training step's loss on 8x64 tokens
is too noisy to compare). ``final_loss_rel_vs_fp32`` = |final - fp32's final| / fp32's
final; goal for mixed: <= 0.01, read against ``fp32_noise_floor_rel`` (fp32_seed1's
figure): a difference below the floor is not one the run can resolve. Ratios are against
the fp32 run of the same invocation. On CPU, bf16 matmuls may be slower than fp32 (no bf16 units):
the step-time figures say what this machine does, not what an accelerator would.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

GOAL_REL = 0.01
MODES = {  # name -> (model.torch_dtype, training.mixed_precision or None for the default, training.seed)
    "fp32": ("float32", None, 0),
    "mixed": ("bfloat16", None, 0),
    "bf16": ("bfloat16", "none", 0),
    # The noise floor: float32 again, only the order of the training rows changed (seed 1).
    "fp32_seed1": ("float32", None, 1),
}


def corpus(folder: Path, limit_bytes: int) -> list[str]:
    """Standard-library sources as ``.txt`` documents under ``folder``, in name order, up to
    ``limit_bytes`` in all; their texts (for the tokenizer)."""
    folder.mkdir(parents=True)
    texts, total = [], 0
    for source in sorted(Path(os.__file__).parent.glob("*.py")):
        text = source.read_text(encoding="utf-8", errors="replace")
        (folder / f"{source.stem}.txt").write_text(text, encoding="utf-8")
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts


def model_folder(folder: Path, texts: list[str], vocab: int, seed: int) -> int:
    """The BPE tokenizer and the random-init Qwen3 model saved in ``folder``; its size."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)
    config = Qwen3Config(vocab_size=vocab, hidden_size=768, intermediate_size=2304, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                         tie_word_embeddings=False, eos_token_id=1)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def recipe(folder: Path, mode: str, args) -> Path:
    """The run's recipe beside the model and corpus folders."""
    dtype, mixed, seed = MODES[mode]
    training = {"steps": args.steps, "global_batch_size": args.batch, "micro_batch_size": args.batch,
                "seq_len": args.seq_len, "seed": seed, "log_every": 10,
                "lr_schedule": {"warmup_steps": args.warmup, "decay": "cosine", "min_lr_ratio": 0.1},
                "eval": {"every_steps": args.steps, "batches": args.eval_batches}}
    if mixed is not None:
        training["mixed_precision"] = mixed
    data = {"model": {"pretrained_model_name_or_path": "model", "torch_dtype": dtype, "attn_implementation": "sdpa"},
            "modeling_backend": "hf",
            "accelerator": {"device_type": "cpu", "nproc_per_node": 1, "nnodes": 1},
            "training": training, "optimizer": {"name": "adamw", "lr": args.lr, "weight_decay": 0.0},
            "dataset": {"kind": "text", "path": "corpus", "sample_by": "document"}}
    path = folder / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def train(folder: Path, mode: str, args) -> dict:
    """One run of the trainer; its figures from the metrics file."""
    metrics = folder / f"{mode}.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                           "-m", "hyper_parallel.trainer", "--config", str(recipe(folder, mode, args)),
                           "--metrics", str(metrics)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: the trainer failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    tail = records[-min(10, len(records)):]
    return {"steps": len(records), "wall_s": round(time.perf_counter() - start, 1),
            "step_s_median": statistics.median(r["seconds"] for r in records[3:] or records),
            "peak_rss_bytes": max(records[-1]["peak_memory_bytes"]),
            "first_loss": records[0]["loss"], "last_10_train_loss": statistics.fmean(r["loss"] for r in tail),
            "final_loss": records[-1]["eval_loss"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8, help="sequences a step (global batch)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=20, help="linear warm-up steps; then cosine decay to 0.1 lr")
    parser.add_argument("--eval-batches", type=int, default=32, help="held-out batches of the final loss")
    parser.add_argument("--corpus-mb", type=float, default=2.0, help="standard-library text to train on")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the rank")
    parser.add_argument("--quick", action="store_true", help="20 steps: checks the bench runs, not the goal")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup = 20, 2
    with tempfile.TemporaryDirectory(prefix="bench_mp_") as tmp:
        folder = Path(tmp)
        texts = corpus(folder / "corpus", int(args.corpus_mb * 2**20))
        parameters = model_folder(folder / "model", texts, vocab=8192, seed=0)
        print(f"model: {parameters / 1e6:.1f}M parameters; corpus: {len(texts)} standard-library files; "
              f"{args.steps} steps of {args.batch}x{args.seq_len} tokens", flush=True)
        runs = {}
        for mode in MODES:
            runs[mode] = train(folder, mode, args)
            print(f"{mode:>5}: step {runs[mode]['step_s_median']:.3f} s (median), peak RSS "
                  f"{runs[mode]['peak_rss_bytes'] / 2**30:.2f} GiB, loss {runs[mode]['first_loss']:.4f} -> "
                  f"{runs[mode]['last_10_train_loss']:.4f} (training, last 10 steps), eval loss {runs[mode]['final_loss']:.4f}, "
                  f"{runs[mode]['wall_s']} s", flush=True)
    base = runs["fp32"]
    for mode, run in runs.items():
        run["step_time_vs_fp32"] = run["step_s_median"] / base["step_s_median"]
        run["peak_rss_vs_fp32"] = run["peak_rss_bytes"] / base["peak_rss_bytes"]
        run["final_loss_rel_vs_fp32"] = abs(run["final_loss"] - base["final_loss"]) / base["final_loss"]
    result = {"parameters": parameters, "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len,
              "lr": args.lr, "runs": runs, "final_loss_rel_vs_fp32": runs["mixed"]["final_loss_rel_vs_fp32"],
              "bf16_final_loss_rel_vs_fp32": runs["bf16"]["final_loss_rel_vs_fp32"],
              "fp32_noise_floor_rel": runs["fp32_seed1"]["final_loss_rel_vs_fp32"], "goal_rel": GOAL_REL,
              "goal_met": runs["mixed"]["final_loss_rel_vs_fp32"] <= GOAL_REL}
    for mode in ("mixed", "bf16", "fp32_seed1"):
        run = runs[mode]
        print(f"{mode}: step time {run['step_time_vs_fp32']:.2f}x fp32, peak RSS {run['peak_rss_vs_fp32']:.2f}x, "
              f"final loss rel. to fp32 {run['final_loss_rel_vs_fp32']:.4f}")
    print(f"goal (mixed final loss within {GOAL_REL} of fp32): {'met' if result['goal_met'] else 'NOT met'}; "
          f"noise floor (fp32, other row order): {result['fp32_noise_floor_rel']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
