"""Benchmark (issue 16): checkpoint save and load seconds and MB/s per rank through the
trainer's own checkpoint code, against ``torch.save``/``torch.load`` of the full state dict
in one process (the floor) measured in the same run; and each rank's peak RSS during
``trainer export`` against its share of the model.

    python bench/checkpoint_io.py [--quick] [--saves 2] [--json OUT]

Models: (a) the tiny recipe's Qwen3-MoE (recipes/tiny_cpu), (b) the same config widened
to ~245M parameters (~0.98 GB fp32: hidden 1024, 8 layers, 8 experts), its weights
written with ``save_pretrained`` from a random init in the temp folder. ``--quick`` runs
(a) only. For each: a throwaway project (the recipe, the model folder, its generated
bundle), then under torchrun (world 2, gloo, CPU, tp 2 as the tiny recipe) every rank
builds the trainer (``BaseTrainer``: model, AdamW, ``Checkpointer``), gives AdamW its
state (one step on zero gradients), and times ``Checkpointer.save`` (DCP, the atomic
publish included) ``--saves`` times and ``Checkpointer.resume`` once (the checks before a
load included). Per rank: seconds, the bytes of its own DCP files, MB/s. Then
``python -m hyper_parallel.trainer export`` runs under torchrun on the last checkpoint,
each rank recording its RSS before the export (torch imported, process group up) and its
peak (getrusage). The floor: the same model and optimizer state (a plain HF model, one
process), ``torch.save`` of ``{"model": ..., "optim": ...}`` and ``torch.load`` of it.
Ratio = ours / floor (seconds: < 1 is faster than the floor). The files are in the page
cache when read back, for ours and the floor alike.

Goal (export): peak RSS per rank <= 1.2x the rank's share of the model (fp32 bytes / world);
the bench prints whether it holds, for the peak and for the peak above the RSS before the
export (what the export itself adds over the interpreter and torch).

About 4-6 minutes on a 2-core machine (``--quick``: about 1): the wide model's saves write
2.9 GB and are bound by the disk, whose speed other work on the machine moves a lot.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY_DIR = REPO / "recipes/tiny_cpu"
TINY_RECIPE = TINY_DIR / "qwen3_moe_tiny.yaml"
TINY_MODEL = TINY_DIR / "models/tiny-qwen3-moe"
WORLD = 2
# The tiny config widened: ~245M parameters, ~0.98 GB in fp32.
BIG_SIZES = {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 128, "num_experts": 8, "moe_intermediate_size": 1024, "intermediate_size": 2048,
             "vocab_size": 8192, "max_position_embeddings": 512}
EXPORT_GOAL = 1.2
MB = 1e6


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{what} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--standalone", *args]


# --- inside the ranks ---------------------------------------------------------------------


def save_load_worker(recipe: str, out: str, saves: int) -> None:
    """One rank: build the trainer, give AdamW its state, time saves and one resume."""
    import torch
    import torch.distributed as dist

    from hyper_parallel.config import load_training_config
    from hyper_parallel.trainer.base import BaseTrainer

    config = load_training_config(recipe)
    trainer = BaseTrainer(config, resume=False)
    rank = dist.get_rank()
    params = list(trainer.model.parameters())
    for param in params:  # AdamW's exp_avg and exp_avg_sq exist after a step
        param.grad = torch.zeros_like(param)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in params)
    full = sum(p.numel() * p.element_size() for p in params)
    ck = trainer.checkpointer
    save_s = []
    for step in range(1, saves + 1):
        dist.barrier()
        start = time.perf_counter()
        ck.save(step)
        dist.barrier()
        save_s.append(time.perf_counter() - start)
    folder = ck.root / f"step_{saves}"
    mine = sum(p.stat().st_size for p in folder.glob(f"__{rank}_*.distcp"))
    dist.barrier()
    start = time.perf_counter()
    resumed = ck.resume(True)
    dist.barrier()
    load_s = time.perf_counter() - start
    assert resumed is not None and resumed.step == saves, resumed
    row = {"rank": rank, "save_s": save_s, "load_s": load_s, "rank_bytes": mine, "local_param_bytes": local,
           "full_param_bytes": full, "checkpoint": str(folder)}
    Path(out, f"io_rank{rank}.json").write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def export_worker(checkpoint: str, hf_out: str, out: str) -> None:
    """One rank of ``python -m hyper_parallel.trainer export`` (the same entry point),
    with its RSS before the export and its peak."""
    import psutil
    import torch.distributed as dist

    from hyper_parallel.trainer.__main__ import main

    dist.init_process_group(backend="gloo")  # export_main reuses it
    rank = dist.get_rank()
    before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    code = main(["export", "--checkpoint", checkpoint, "--out", hf_out])  # destroys the process group
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    Path(out, f"export_rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "code": code, "rss_before": before, "peak_rss": peak, "export_s": seconds}))
    if code:
        sys.exit(code)


# --- the driver ---------------------------------------------------------------------------


def _project(tmp: Path, name: str, sizes: dict | None, saves: int) -> tuple[Path, Path]:
    """A throwaway project: recipes/<name>.yaml, its model folder (random weights through
    save_pretrained for the widened config), and the generated bundle. Returns (project, recipe)."""
    import torch
    import transformers
    import yaml

    project = tmp / name
    model_dir = project / "recipes/models" / name
    model_dir.mkdir(parents=True)
    config = json.loads((TINY_MODEL / "config.json").read_text())
    if sizes:
        config.update(sizes)
        hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
        hf_config.architectures = config["architectures"]
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        model.save_pretrained(str(model_dir))
        del model
    else:  # the tiny model as the tiny recipe has it (config only: freshly initialized)
        shutil.copytree(TINY_MODEL, model_dir, dirs_exist_ok=True)
    data = yaml.safe_load(TINY_RECIPE.read_text())
    data["model"]["pretrained_model_name_or_path"] = f"models/{name}"
    data["model"]["init"] = "pretrained" if sizes else "random"  # the widened model's saved weights
    data["training"].update(steps=saves, checkpoint={"dir": "checkpoints", "every_steps": 1000, "keep_last": 0})
    recipe = project / "recipes" / f"{name}.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    _run([sys.executable, "-m", "hyper_parallel.codegen", "generate", "--config", str(recipe), "--skip-preflight"],
         project, f"generating {name}")
    return project, recipe


def _floor(project: Path, name: str, tmp: Path) -> dict:
    """torch.save / torch.load of the whole model and AdamW state in one process."""
    import torch
    import transformers

    model_dir = project / "recipes/models" / name
    if any(model_dir.glob("*.safetensors")):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(model_dir)),
                                                              dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    path = tmp / f"{name}-floor.pt"
    start = time.perf_counter()
    torch.save(state, path)
    with open(path, "rb+") as handle:  # DCP's writer fsyncs its files: so does the floor
        os.fsync(handle.fileno())
    save_s = time.perf_counter() - start
    size = path.stat().st_size
    del state, model, optimizer
    start = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    load_s = time.perf_counter() - start
    del loaded
    path.unlink()
    return {"save_s": save_s, "load_s": load_s, "bytes": size}


def bench_model(name: str, sizes: dict | None, saves: int, tmp: Path) -> dict:
    print(f"[{name}] project and generated bundle ...", flush=True)
    project, recipe = _project(tmp, name, sizes, saves)
    print(f"[{name}] floor: torch.save / torch.load in one process ...", flush=True)
    floor = _floor(project, name, tmp)
    out = tmp / f"{name}-out"
    out.mkdir()
    print(f"[{name}] torchrun x{WORLD}: {saves} checkpoint saves and a resume ...", flush=True)
    _run(_torchrun(str(Path(__file__).resolve()), "--save-load-worker", str(recipe), str(out), str(saves)),
         project, f"{name}: save/load ranks")
    ranks = [json.loads((out / f"io_rank{r}.json").read_text()) for r in range(WORLD)]
    print(f"[{name}] torchrun x{WORLD}: export ...", flush=True)
    checkpoint = ranks[0]["checkpoint"]
    _run(_torchrun(str(Path(__file__).resolve()), "--export-worker", checkpoint, str(tmp / f"{name}-hf"), str(out)),
         project, f"{name}: export ranks")
    exports = [json.loads((out / f"export_rank{r}.json").read_text()) for r in range(WORLD)]
    total = sum(r["rank_bytes"] for r in ranks)
    model_bytes = ranks[0]["full_param_bytes"]
    share = model_bytes / WORLD
    save_wall = [max(r["save_s"][i] for r in ranks) for i in range(saves)]
    first_save, steady_save = save_wall[0], min(save_wall[1:] or save_wall)
    load_wall = max(r["load_s"] for r in ranks)
    rows = []
    for r, e in zip(ranks, exports):
        steady = min(r["save_s"][1:] or r["save_s"])
        rows.append({
            "rank": r["rank"], "bytes": r["rank_bytes"], "save_s_first": round(r["save_s"][0], 3),
            "save_s": round(steady, 3), "save_MBps": round(r["rank_bytes"] / MB / steady, 1),
            "load_s": round(r["load_s"], 3), "load_MBps": round(r["rank_bytes"] / MB / r["load_s"], 1),
            "export_s": round(e["export_s"], 3), "rss_before_MB": round(e["rss_before"] / MB, 1),
            "peak_rss_MB": round(e["peak_rss"] / MB, 1), "share_MB": round(share / MB, 1),
            "peak_over_share": round(e["peak_rss"] / share, 2),
            "added_over_share": round((e["peak_rss"] - e["rss_before"]) / share, 2)})
    floor_save_MBps, floor_load_MBps = floor["bytes"] / MB / floor["save_s"], floor["bytes"] / MB / floor["load_s"]
    return {
        "model": name, "params": model_bytes // 4, "model_MB": round(model_bytes / MB, 1),
        "checkpoint_MB": round(total / MB, 1), "world": WORLD, "saves": saves,
        "ours": {"save_s_first": round(first_save, 3), "save_s": round(steady_save, 3),
                 "save_MBps": round(total / MB / steady_save, 1), "load_s": round(load_wall, 3),
                 "load_MBps": round(total / MB / load_wall, 1)},
        "floor": {"bytes_MB": round(floor["bytes"] / MB, 1), "save_s": round(floor["save_s"], 3),
                  "save_MBps": round(floor_save_MBps, 1), "load_s": round(floor["load_s"], 3),
                  "load_MBps": round(floor_load_MBps, 1)},
        "ratio": {"save_s": round(steady_save / floor["save_s"], 2), "load_s": round(load_wall / floor["load_s"], 2),
                  "save_MBps_per_rank": [round(row["save_MBps"] / floor_save_MBps, 2) for row in rows],
                  "load_MBps_per_rank": [round(row["load_MBps"] / floor_load_MBps, 2) for row in rows]},
        "ranks": rows,
        "export_goal": EXPORT_GOAL,
        "export_goal_peak_met": all(row["peak_over_share"] <= EXPORT_GOAL for row in rows),
        "export_goal_added_met": all(row["added_over_share"] <= EXPORT_GOAL for row in rows),
    }


def _print(result: dict) -> None:
    ours, floor, ratio = result["ours"], result["floor"], result["ratio"]
    print(f"\n== {result['model']}: {result['params'] / 1e6:.1f}M parameters, {result['model_MB']:.1f} MB fp32; "
          f"checkpoint (model + AdamW) {result['checkpoint_MB']:.1f} MB over {result['world']} ranks")
    print(f"{'':24}{'save s':>9}{'save MB/s':>11}{'load s':>9}{'load MB/s':>11}")
    print(f"{'ours (world, wall)':24}{ours['save_s']:9.3f}{ours['save_MBps']:11.1f}{ours['load_s']:9.3f}"
          f"{ours['load_MBps']:11.1f}   (first save {ours['save_s_first']:.3f} s)")
    for row in result["ranks"]:
        label = f"  rank {row['rank']} ({row['bytes'] / MB:.1f} MB)"
        print(f"{label:24}{row['save_s']:9.3f}"
              f"{row['save_MBps']:11.1f}{row['load_s']:9.3f}{row['load_MBps']:11.1f}")
    print(f"{'floor (1 process)':24}{floor['save_s']:9.3f}{floor['save_MBps']:11.1f}{floor['load_s']:9.3f}"
          f"{floor['load_MBps']:11.1f}   ({floor['bytes_MB']:.1f} MB, torch.save/torch.load)")
    print(f"{'ratio ours/floor (s)':24}{ratio['save_s']:9.2f}{'':11}{ratio['load_s']:9.2f}")
    print(f"{'ratio MB/s per rank':24}{'':9}{' '.join(map(str, ratio['save_MBps_per_rank'])):>11}{'':9}"
          f"{' '.join(map(str, ratio['load_MBps_per_rank'])):>11}")
    print(f"export under torchrun x{result['world']}:")
    for row in result["ranks"]:
        print(f"  rank {row['rank']}: {row['export_s']:.2f} s, peak RSS {row['peak_rss_MB']:.1f} MB "
              f"(before the export {row['rss_before_MB']:.1f} MB), share {row['share_MB']:.1f} MB: "
              f"peak/share {row['peak_over_share']:.2f}, (peak - before)/share {row['added_over_share']:.2f}")
    goal = result["export_goal"]
    print(f"  goal peak RSS <= {goal}x share: {'met' if result['export_goal_peak_met'] else 'NOT met'}; "
          f"above the RSS before the export: {'met' if result['export_goal_added_met'] else 'NOT met'}")
    if any(row["rss_before_MB"] > row["share_MB"] for row in result["ranks"]):
        print("  (the share is below the RSS of the interpreter and torch alone: the goal is read on a large model)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny model only")
    parser.add_argument("--saves", type=int, default=2, help="saves timed per model (the first is reported apart)")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--save-load-worker", nargs=3, metavar=("RECIPE", "OUT", "SAVES"), help=argparse.SUPPRESS)
    parser.add_argument("--export-worker", nargs=3, metavar=("CHECKPOINT", "HF_OUT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.save_load_worker:
        recipe, out, saves = args.save_load_worker
        return save_load_worker(recipe, out, int(saves))
    if args.export_worker:
        return export_worker(*args.export_worker)

    import transformers

    transformers.utils.logging.disable_progress_bar()
    models = [("tiny-qwen3-moe", None)] + ([] if args.quick else [("wide-qwen3-moe", BIG_SIZES)])
    results = []
    with tempfile.TemporaryDirectory(prefix="hp-bench-ckpt-") as tmp:
        for name, sizes in models:
            start = time.perf_counter()
            results.append(bench_model(name, sizes, args.saves, Path(tmp)))
            print(f"[{name}] done in {time.perf_counter() - start:.0f} s", flush=True)
            shutil.rmtree(Path(tmp) / name, ignore_errors=True)  # its checkpoints: the disk back
    for result in results:
        _print(result)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
