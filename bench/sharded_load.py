"""Benchmark: per-rank resident parameter bytes after sharded loading, vs the full model.

    python bench/sharded_load.py [--tp 2] [--json OUT]

Saves a random Qwen3-MoE (8 experts, hidden 512, 4 layers) as safetensors, then under
torchrun (gloo, CPU) every rank plans on the meta device, applies the plan and reads
only its own slices from the checkpoint. Prints, per rank, the bytes it read and keeps
against the full model, overall and for the sharded parameters alone (goal: ~1/tp).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe/config.json"
SIZES = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 64, "num_experts": 8, "moe_intermediate_size": 256, "intermediate_size": 1024,
         "vocab_size": 4096}


def worker(model_dir: str, out: str) -> None:
    import accelerate
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.tensor import DTensor, Replicate

    from hyper_parallel.distributed.applier import apply_sharding_plan
    from hyper_parallel.config.layout import Layout
    from hyper_parallel.distributed.mesh import MeshContext, ParallelDims, build_device_mesh
    from hyper_parallel.planning.planner import ShardingPlanner
    from hyper_parallel.distributed.sharded_load import materialize_and_load

    dims = ParallelDims(tp=int(os.environ["WORLD_SIZE"]))
    mesh = build_device_mesh(dims, "cpu")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with accelerate.init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    apply_sharding_plan(model, ShardingPlanner(model, Layout(dims)).plan().modules,
                        MeshContext(mesh, Layout(dims)))
    report = materialize_and_load(model, model_dir)
    local = full = sharded_local = sharded_full = 0
    for param in model.parameters():
        whole = param.numel() * param.element_size()
        mine = param.to_local().nbytes if isinstance(param, DTensor) else whole
        local, full = local + mine, full + whole
        if isinstance(param, DTensor) and any(not isinstance(p, Replicate) for p in param.placements):
            sharded_local, sharded_full = sharded_local + mine, sharded_full + whole
    row = {"rank": dist.get_rank(), "bytes_read": report.bytes_read, "local_bytes": local, "full_bytes": full,
           "sharded_local_bytes": sharded_local, "sharded_full_bytes": sharded_full,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)

    import torch
    import transformers
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="hp-bench-load-") as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        config = {**json.loads(CONFIG.read_text()), **SIZES}
        (model_dir / "config.json").write_text(json.dumps(config))
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(model_dir / "model.safetensors"))
        del model
        subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.tp}",
                        "--standalone", str(Path(__file__).resolve()), "--worker", str(model_dir), tmp],
                       check=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(args.tp)]
    for row in rows:
        print(f"rank {row['rank']}: read {row['bytes_read'] / 2**20:7.2f} MiB, keeps {row['local_bytes'] / 2**20:7.2f} MiB "
              f"of {row['full_bytes'] / 2**20:7.2f} MiB ({row['local_bytes'] / row['full_bytes']:.3f}); "
              f"sharded parameters {row['sharded_local_bytes'] / row['sharded_full_bytes']:.3f} of full "
              f"(goal ~{1 / args.tp:.3f}); peak RSS {row['peak_rss_mib']:.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
