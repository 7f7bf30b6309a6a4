"""Benchmark: our generated bundle vs transformers' own tensor parallel, world 2 on CPU.

    python bench/gen_vs_peer.py [--steps 20] [--repeats N] [--json PATH]

Copies dodo.py and recipes/ into a temp folder and generates the tiny recipe's bundle
with the CLI (``--skip-preflight``). Then, on the same tiny qwen3_moe checkpoint, two
torchrun runs (world 2, gloo, OMP_NUM_THREADS=1):

- gen:  import the bundle (``load_generated_module``), build its model class on the meta
        device, ``hyper_parallelize`` it, read each rank's slices of the checkpoint;
- peer: ``AutoModelForCausalLM.from_pretrained(dir, tp_plan="auto")``.

Each trains with AdamW (forward + backward + step) and reports the wall time from the
torchrun launch to the first loss, and the median step time over ``--steps`` steps
after it. Prints both and the ratio gen/peer; goal: ratio <= 1.0 for both.
The runs alternate (gen, peer, gen, peer, ...) ``--repeats`` times; medians are reported.
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

REPO = Path(__file__).resolve().parents[1]
TINY_RECIPE = "recipes/tiny_cpu/qwen3_moe_tiny.yaml"
TINY_CONFIG = REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"
BATCH, SEQ = 2, 16
PATHS = ("gen", "peer")


# --- launcher --------------------------------------------------------------------------------


def make_project(dest: Path) -> Path:
    """dodo.py + recipes/ without build outputs, as tests/project_fixtures.make_project does."""
    dest.mkdir(parents=True)
    shutil.copy(REPO / "dodo.py", dest / "dodo.py")
    shutil.copytree(REPO / "recipes", dest / "recipes", ignore=shutil.ignore_patterns("generated", "__pycache__"))
    return dest


def clean_env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def generate_bundle(project: Path) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hyper_parallel.codegen", "generate", "--config", TINY_RECIPE,
                           "--skip-preflight"], cwd=project, env=clean_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"generate failed:\n{proc.stdout}\n{proc.stderr}")
    return time.perf_counter() - start


def save_checkpoint(model_dir: Path) -> None:
    """Random weights as an HF checkpoint (``save_pretrained``: the hub's per-expert layout),
    read by both paths."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(TINY_CONFIG)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(model_dir)



def launch(path: str, args, bundle: Path, model_dir: Path, out: Path) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", str(Path(__file__).resolve()), "--worker", path,
               "--bundle", str(bundle), "--model-dir", str(model_dir),
               "--steps", str(args.steps), "--out", str(out), "--t0", repr(time.time())]
    proc = subprocess.run(command, cwd=REPO, env=clean_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{path} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_benchmark(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="gen_vs_peer_") as tmp:
        tmp = Path(tmp)
        project = make_project(tmp / "project")
        generate_s = generate_bundle(project)
        model_dir = tmp / "tiny-qwen3-moe"
        save_checkpoint(model_dir)
        runs: dict[str, list[dict]] = {path: [] for path in PATHS}
        for repeat in range(args.repeats):
            for path in PATHS:
                runs[path].append(launch(path, args, project / "recipes/tiny_cpu/generated", model_dir,
                                         tmp / f"{path}{repeat}.json"))
    report = {"world_size": 2, "steps": args.steps, "repeats": args.repeats, "generate_s": round(generate_s, 3)}
    for path in PATHS:
        report[path] = {
            "start_to_first_loss_s": statistics.median(r["start_to_first_loss_s"] for r in runs[path]),
            "median_step_s": statistics.median(r["median_step_s"] for r in runs[path]),
            "first_loss": runs[path][0]["first_loss"],
        }
    report["ratio_gen_over_peer"] = {
        key: report["gen"][key] / report["peer"][key] for key in ("start_to_first_loss_s", "median_step_s")}
    return report


def print_table(report: dict) -> None:
    print(f"world 2, CPU (gloo), tiny qwen3_moe, {report['steps']} steps, median of {report['repeats']} runs "
          f"(bundle generated once in {report['generate_s']:.2f}s, not counted)")
    print(f"{'':24}{'gen':>12}{'peer':>12}{'gen/peer':>10}")
    for key, label in (("start_to_first_loss_s", "start -> first loss (s)"), ("median_step_s", "median step (s)")):
        ratio = report["ratio_gen_over_peer"][key]
        verdict = "ok" if ratio <= 1.0 else "ABOVE GOAL"
        print(f"{label:24}{report['gen'][key]:12.4f}{report['peer'][key]:12.4f}{ratio:10.3f}  {verdict}")
    print(f"first loss: gen {report['gen']['first_loss']:.6f}  peer {report['peer']['first_loss']:.6f}")


# --- worker (runs under torchrun) ------------------------------------------------------------


def build_gen(bundle: str, model_dir: str):
    """What HyperAutoModel's gen path does: the bundle's class on the meta device, its
    hyper_parallelize(), then only this rank's slices read from the checkpoint."""
    import accelerate
    import transformers

    from hyper_parallel.runtime.loader import load_generated_module
    from hyper_parallel.runtime.meta import load_codegen_meta
    from hyper_parallel.config.layout import Layout
    from hyper_parallel.distributed.mesh import MeshContext, ParallelDims, build_device_mesh
    from hyper_parallel.distributed.sharded_load import materialize_and_load

    dims = ParallelDims(tp=2)
    mesh_context = MeshContext(build_device_mesh(dims, "cpu"), Layout(dims))
    module = load_generated_module(bundle)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "eager"
    with accelerate.init_empty_weights(include_buffers=False):
        model = getattr(module, load_codegen_meta(bundle)["model"]["model_class"])(config)
    module.hyper_parallelize(model, mesh_context)
    materialize_and_load(model, model_dir)
    return model


def build_peer(model_dir: str):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32,
                                                             attn_implementation="eager")


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    model = build_gen(args.bundle, args.model_dir) if args.worker == "gen" else build_peer(args.model_dir)
    batch = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_times, first_loss, first_loss_at = [], None, None
    for _ in range(args.steps + 1):  # the first step (first loss) is not in the median
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = model(input_ids=batch, labels=batch).loss
        if first_loss is None:
            first_loss, first_loss_at = loss.item(), time.time()
        loss.backward()
        optimizer.step()
        step_times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({
            "start_to_first_loss_s": first_loss_at - args.t0,
            "median_step_s": statistics.median(step_times[1:]),
            "first_loss": first_loss,
        }))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps after the first (>= 20)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per path (medians are reported)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON here")
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    for hidden in ("--bundle", "--model-dir", "--out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.steps < 20:
        parser.error(f"--steps must be >= 20, got {args.steps}")
    report = run_benchmark(args)
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
