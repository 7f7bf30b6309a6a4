"""Data at scale: a rank's start-up time and peak memory against the corpus size, with the
token cache cold (the first start tokenizes) and warm (a second start maps the cache).

    python bench/data_scale.py --json /tmp/data_scale.json       # 10 MB, 100 MB, 1 GB of JSON lines
    python bench/data_scale.py --sizes-mb 10,100                 # quicker

Per size, a corpus of JSON-lines documents (random words, deterministic) is written in files
of at most 256 MB, and a byte-level BPE tokenizer (8k vocabulary, trained here with
``tokenizers``) is saved next to a tiny model's config. Each start is a real
``torchrun --nproc_per_node=2`` launch of this file's rank worker, which does what the
trainer does before building the model: ``prepare_corpus_on_every_node`` (local rank 0
fills a missing cache entry, the other rank waits and maps it), then reads one step's rows.
Each rank reports its wall time in that call and its peak RSS (``ru_maxrss``, this
process; the largest process it started, e.g. a tokenizer worker, is reported apart).

Figures and goals (issue 31):

- ``rss_ratio``: each rank's peak RSS at the largest size over the smallest (goal <= 1.2:
  the rows are written as they are tokenized and memory-mapped, never held);
- ``warm_over_cold``: a second start's time in the call over the first start's (goal <= 0.05);
- ``prepare_over_baseline``: the first start's tokens/s over one ``tokenizer(texts)`` call on
  in-memory documents of the same corpus (10 MB of them), measured in this run: what reading,
  packing and writing the cache cost, or gain with tokenizer processes.
"""

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"
FILE_LIMIT = 256 << 20
SEQ_LEN = 512


def _words(count: int = 20000) -> list[str]:
    rng = random.Random(0)
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(count)]


def _documents(seed: int):
    """An endless stream of documents of 20 to 400 random words."""
    rng, words = random.Random(seed), _words()
    while True:
        yield " ".join(rng.choices(words, k=rng.randint(20, 400)))


def write_corpus(folder: Path, megabytes: int) -> int:
    """JSON lines of at least ``megabytes`` MB in files of at most 256 MB; the bytes written."""
    folder.mkdir(parents=True)
    total, part, handle, size = 0, 0, None, 0
    for text in _documents(megabytes):
        if handle is None or size >= FILE_LIMIT:
            if handle is not None:
                handle.close()
            handle, size, part = open(folder / f"part-{part:03d}.jsonl", "w"), 0, part + 1
        line = json.dumps({"text": text}) + "\n"
        handle.write(line)
        size += len(line)
        total += len(line)
        if total >= megabytes * 1_000_000:
            break
    handle.close()
    return total


def write_model(folder: Path) -> None:
    """The tiny model's config with a byte-level BPE tokenizer trained on this corpus' words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(TINY_MODEL, folder)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    sample = _documents(-1)
    tokenizer.train_from_iterator((next(sample) for _ in range(3000)), trainers.BpeTrainer(
        vocab_size=8000, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 8000
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def write_recipe(folder: Path, data: str) -> Path:
    import yaml

    recipe = {"model": {"pretrained_model_name_or_path": "model"},
              "accelerator": {"nproc_per_node": 2, "dp_size": 2},
              "training": {"steps": 1, "global_batch_size": 4, "micro_batch_size": 1, "seq_len": SEQ_LEN},
              "dataset": {"kind": "jsonl", "path": data, "cache_dir": "tokens"}}
    path = folder / f"recipe-{data}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def baseline_tokens_per_s(model: Path, data: Path, megabytes: int = 10) -> float:
    """One ``tokenizer(texts)`` call on the first ``megabytes`` MB of documents, in memory."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    texts, size = [], 0
    with open(sorted(data.iterdir())[0]) as handle:
        for line in handle:
            texts.append(json.loads(line)["text"])
            size += len(line)
            if size >= megabytes * 1_000_000:
                break
    started = time.perf_counter()
    ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    seconds = time.perf_counter() - started
    return sum(map(len, ids)) / seconds


def run_rank(args) -> None:
    """A rank's start: the trainer's corpus step, then one step's rows."""
    import torch.distributed as dist

    from hyper_parallel.config import load_training_config
    from hyper_parallel.models.hf.model_builder import recipe_model_dir
    from hyper_parallel.trainer.corpus import corpus_batch, dataset_files, prepare_corpus_on_every_node
    from hyper_parallel.trainer.tokenize import worker_count

    dist.init_process_group("gloo")
    config = load_training_config(args.recipe)
    started = time.perf_counter()
    corpus = prepare_corpus_on_every_node(config.dataset, config.training, recipe_model_dir(config), config.where,
                                          log=dist.get_rank() == 0)
    batch = corpus_batch(corpus, 0, config.training, shuffle=True)
    seconds = time.perf_counter() - started
    result = {"seconds": seconds, "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
              "children_rss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
              "rows": corpus.num_rows, "batch_sum": int(batch.sum()),
              "tokens": json.loads((corpus.cache / "index.json").read_text())["tokens"],
              "tokenize_workers": worker_count(config.dataset, sum(f.stat().st_size for f in
                                                                   dataset_files(config.dataset, config.where)))}
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def start(recipe: Path) -> list[dict]:
    """One torchrun launch of two ranks; each rank's report."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                   "--rank-worker", "--recipe", str(recipe), "--out", out]
        done = subprocess.run(command, capture_output=True, text=True, timeout=7200, cwd=recipe.parent)
        if done.returncode:
            raise SystemExit(f"start on {recipe} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(2)]


def measure(work: Path, megabytes: int) -> dict:
    data = f"corpus-{megabytes}mb"
    written = write_corpus(work / data, megabytes)
    recipe = write_recipe(work, data)
    cold, warm = start(recipe), start(recipe)
    tokens = cold[0]["tokens"]
    row = {"megabytes": round(written / 1e6, 1), "tokens": tokens, "rows": cold[0]["rows"],
           "tokenize_workers": cold[0]["tokenize_workers"],
           "cold_s": [round(r["seconds"], 2) for r in cold], "warm_s": [round(r["seconds"], 3) for r in warm],
           "cold_rss_mib": [round(r["rss_kib"] / 1024, 1) for r in cold],
           "warm_rss_mib": [round(r["rss_kib"] / 1024, 1) for r in warm],
           "children_rss_mib": round(cold[0]["children_rss_kib"] / 1024, 1),
           "prepare_tokens_per_s": round(tokens / cold[0]["seconds"])}
    row["warm_over_cold"] = round(max(row["warm_s"]) / cold[0]["seconds"], 4)
    assert cold[0]["batch_sum"] == warm[0]["batch_sum"], "the warm start read other rows"
    shutil.rmtree(work / data)  # the next size's disk
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--sizes-mb", default="10,100,1000", help="comma-separated corpus sizes in MB")
    parser.add_argument("--work", help="a folder for the corpora and the cache (default: a temporary one)")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--recipe", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        run_rank(args)
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="data_scale-"))
    write_model(work / "model")
    rows = []
    for megabytes in (int(size) for size in args.sizes_mb.split(",")):
        if megabytes == min(int(s) for s in args.sizes_mb.split(",")):
            write_corpus(work / "baseline", megabytes)
            baseline = baseline_tokens_per_s(work / "model", work / "baseline")
            shutil.rmtree(work / "baseline")
        row = measure(work, megabytes)
        row["prepare_over_baseline"] = round(row["prepare_tokens_per_s"] / baseline, 3)
        rows.append(row)
        print(f"{row['megabytes']:>8,.1f} MB  {row['tokens']:>12,} tokens  cold {max(row['cold_s']):7.1f}s  warm "
              f"{max(row['warm_s']):6.3f}s ({row['warm_over_cold']:.4f} of cold)  peak RSS per rank cold "
              f"{row['cold_rss_mib']} MiB, warm {row['warm_rss_mib']} MiB; largest child process "
              f"{row['children_rss_mib']} MiB; tokenize_workers {row['tokenize_workers']}: "
              f"{row['prepare_tokens_per_s'] / 1e6:.2f} M tokens/s "
              f"({row['prepare_over_baseline']:.2f}x one tokenizer call)", flush=True)
    first, last = rows[0], rows[-1]
    rss_ratio = max(max(last["cold_rss_mib"][rank], last["warm_rss_mib"][rank])
                    / max(first["cold_rss_mib"][rank], first["warm_rss_mib"][rank]) for rank in range(2))
    warm = max(row["warm_over_cold"] for row in rows)
    summary = {"baseline_tokens_per_s": round(baseline), "rows": rows,
               "rss_ratio": round(rss_ratio, 3), "rss_goal": 1.2, "rss_pass": rss_ratio <= 1.2,
               "warm_over_cold": warm, "warm_goal": 0.05, "warm_pass": warm <= 0.05}
    print(f"baseline: one tokenizer call {baseline / 1e6:.2f} M tokens/s")
    print(f"peak RSS per rank, {last['megabytes']:,.0f} MB over {first['megabytes']:,.0f} MB: {rss_ratio:.3f} "
          f"(goal <= 1.2: {'PASS' if summary['rss_pass'] else 'FAIL'})")
    print(f"second start over first: {warm:.4f} at most (goal <= 0.05: {'PASS' if summary['warm_pass'] else 'FAIL'})")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if not args.work:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
