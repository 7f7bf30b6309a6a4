"""torchrun worker: plan + apply on a meta model, then each rank reads only its shards
from safetensors, placed by the recorded weight map; the result must equal the
single-process HF model.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.distributed.sharded_load_worker \
        --model-dir DIR --out OUT_DIR
"""

import json
from pathlib import Path

import accelerate
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
import transformers
from safetensors.torch import load_file

from hyper_parallel.distributed.applier import apply_sharding_plan
from hyper_parallel.distributed.mesh import build_offline_mesh
from hyper_parallel.distributed.planner import ShardingPlanner
from hyper_parallel.distributed.sharded_load import materialize_and_load
from hyper_parallel.distributed.weight_map import weight_map_text
from tests.distributed.tp_equivalence_worker import one_step_against_reference, start_tp2_worker
from tests.rank_exit import leave_after_barrier


def main() -> None:
    args, mesh_context = start_tp2_worker("--model-dir", "--out")
    dims = mesh_context.dims
    config = transformers.AutoConfig.from_pretrained(args.model_dir)
    with accelerate.init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    plan = ShardingPlanner(model, dims=dims, mesh=build_offline_mesh(dims)).plan()
    apply_sharding_plan(model, plan.modules, mesh_context)
    # the map codegen records (per-expert layout, from a meta model); a fused checkpoint
    # holds the model's own names, which load as they are
    with torch.device("meta"):
        recorded = weight_map_text(transformers.AutoModelForCausalLM.from_config(config))
    report = materialize_and_load(model, args.model_dir, weight_map=recorded)

    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    reference.load_state_dict(load_file(str(Path(args.model_dir) / "reference.safetensors.ref")))
    ref_loss, loss, failures, checked = one_step_against_reference(reference, model, config.vocab_size,
                                                                   seq_len=10, seed=3)
    full_bytes = sum(p.nbytes for p in reference.parameters())
    result = {"ref_loss": ref_loss.item(), "loss": loss.item(), "grad_failures": failures, "grads_checked": checked,
              "bytes_read": report.bytes_read, "full_param_bytes": full_bytes,
              # a replicated parameter with whole inputs stays a plain tensor: all of it is local
              "local_param_bytes": sum((p.to_local() if isinstance(p, DTensor) else p).nbytes
                                       for p in model.parameters())}
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    leave_after_barrier(dist)


if __name__ == "__main__":
    main()
