"""torchrun worker: plan + apply on a meta model, then each rank reads only its shards
from safetensors, placed by the recorded weight map; the result must equal the
single-process HF model.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.distributed.sharded_load_worker \
        --model-dir DIR --out OUT_DIR

``--cases FILE`` (instead of ``--model-dir``) loads several model folders in turn in the
same processes, on the same tp2 mesh (one launch instead of one per folder): FILE is a
JSON object ``{name: ["--model-dir", DIR]}``; each writes ``OUT_DIR/<name>/rank<N>.json``,
and one that raises writes ``OUT_DIR/<name>/error_rank<N>.txt`` and ends the rank with
exit code 1 (tests/batch_launch.py reads them).
"""

import argparse
import json
from pathlib import Path

import accelerate
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
import transformers
from safetensors.torch import load_file

from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.applier import apply_sharding_plan
from hyper_parallel.distributed.mesh import MeshContext, ParallelDims, build_device_mesh
from hyper_parallel.distributed.sharded_load import materialize_and_load
from hyper_parallel.distributed.weight_map import weight_map_text
from hyper_parallel.planning.planner import ShardingPlanner
from tests.batch_worker import run_cases
from tests.distributed.tp_equivalence_worker import one_step_against_reference
from tests.rank_exit import leave_after_barrier


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--model-dir")
    target.add_argument("--cases", help="JSON file {name: ['--model-dir', DIR]}: load these folders in turn")
    args = parser.parse_args()
    dims = ParallelDims(tp=2)
    mesh_context = MeshContext(build_device_mesh(dims, "cpu"), Layout(dims))
    if args.cases is None:
        result = load_and_compare(args.model_dir, mesh_context)
        Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    else:
        run_cases(args.cases, args.out,
                  lambda flags: load_and_compare(flags[flags.index("--model-dir") + 1], mesh_context))
    leave_after_barrier(dist)


def load_and_compare(model_dir: str, mesh_context) -> dict:
    """The model of ``model_dir`` loaded shard by shard at tp2 against the HF model of its
    ``reference.safetensors.ref``: one step's losses and gradients, and the bytes read."""
    dims = mesh_context.dims
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with accelerate.init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    plan = ShardingPlanner(model, Layout(dims)).plan()
    apply_sharding_plan(model, plan.modules, mesh_context)
    # the map codegen records (per-expert layout, from a meta model); a fused checkpoint
    # holds the model's own names, which load as they are
    with torch.device("meta"):
        recorded = weight_map_text(transformers.AutoModelForCausalLM.from_config(config))
    report = materialize_and_load(model, model_dir, weight_map=recorded)

    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    reference.load_state_dict(load_file(str(Path(model_dir) / "reference.safetensors.ref")))
    ref_loss, loss, failures, checked = one_step_against_reference(reference, model, config.vocab_size,
                                                                   seq_len=10, seed=3)
    full_bytes = sum(p.nbytes for p in reference.parameters())
    result = {"ref_loss": ref_loss.item(), "loss": loss.item(), "grad_failures": failures, "grads_checked": checked,
              "bytes_read": report.bytes_read, "full_param_bytes": full_bytes,
              # a replicated parameter with whole inputs stays a plain tensor: all of it is local
              "local_param_bytes": sum((p.to_local() if isinstance(p, DTensor) else p).nbytes
                                       for p in model.parameters())}
    return result


if __name__ == "__main__":
    main()
