"""torchrun worker: the GENERATED tiny qwen3_moe bundle, parallelized by its own
hyper_parallelize(), vs the single-process HF model on the same weights.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.pipeline.generated_tp_worker \
        --bundle B --config-dir C --weights W.safetensors --out OUT_DIR
"""

import json
from pathlib import Path

import torch.distributed as dist
import transformers
from safetensors.torch import load_file

from hyper_parallel.runtime.loader import load_generated_module
from hyper_parallel.runtime.meta import load_codegen_meta
from tests.distributed.tp_equivalence_worker import build_model, one_step_against_reference, start_tp2_worker
from tests.rank_exit import leave_after_barrier


def main() -> None:
    args, mesh_context = start_tp2_worker("--bundle", "--config-dir", "--weights", "--out")
    config = transformers.AutoConfig.from_pretrained(args.config_dir)
    config._attn_implementation = "eager"
    weights = load_file(args.weights)

    module = load_generated_module(args.bundle)
    model_class = getattr(module, load_codegen_meta(args.bundle)["model"]["model_class"])
    generated = model_class(config)
    generated.load_state_dict(weights, strict=True)
    module.hyper_parallelize(generated, mesh_context)
    reference = build_model(config, weights)

    ref_loss, gen_loss, failures, checked = one_step_against_reference(reference, generated, config.vocab_size,
                                                                       seq_len=12, seed=11)
    result = {
        "rank": dist.get_rank(),
        "generated_class_module": type(generated).__module__,
        "ref_loss": ref_loss.item(),
        "gen_loss": gen_loss.item(),
        "grad_failures": failures,
        "grads_checked": checked,
        "param_count": sum(1 for _ in generated.parameters()),
    }
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    leave_after_barrier(dist)


if __name__ == "__main__":
    main()
