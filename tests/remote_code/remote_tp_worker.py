"""torchrun worker: the GENERATED bundle of a remote-code model, parallelized by its own
hyper_parallelize(), vs the single-process remote model on the same weights.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.remote_code.remote_tp_worker \
        --bundle B --model-dir M --weights W.safetensors --out OUT_DIR
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file

from hyper_parallel.runtime.loader import load_generated_module
from hyper_parallel.runtime.meta import load_codegen_meta
from tests.distributed.tp_equivalence_worker import one_step_against_reference, start_tp2_worker
from tests.rank_exit import leave_after_barrier


def build_remote_model(model_dir: str, weights: dict | None = None):
    """The model folder's own code, as one process runs it (HF's trust_remote_code path);
    freshly initialized (seed it) when ``weights`` is None."""
    config = transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
    model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=True,
                                                          attn_implementation="eager", dtype=torch.float32)
    if weights is not None:
        model.load_state_dict(weights, strict=True)
    return model, config


def main() -> None:
    args, mesh_context = start_tp2_worker("--bundle", "--model-dir", "--weights", "--out")
    weights = load_file(args.weights)
    reference, config = build_remote_model(args.model_dir, weights)

    module = load_generated_module(args.bundle)
    model_class = getattr(module, load_codegen_meta(args.bundle)["model"]["model_class"])
    generated = model_class(config)
    generated.load_state_dict(weights, strict=True)
    module.hyper_parallelize(generated, mesh_context)

    ref_loss, gen_loss, failures, checked = one_step_against_reference(reference, generated, config.vocab_size,
                                                                       seq_len=12, seed=11)
    qkv = generated.get_submodule("model.layers.1.self_attn.qkv_proj").weight
    result = {
        "rank": dist.get_rank(),
        "generated_class_module": type(generated).__module__,
        "reference_class_module": type(reference).__module__,
        "config_class_module": module.FusedDecoderConfig.__module__,
        "ref_loss": ref_loss.item(),
        "gen_loss": gen_loss.item(),
        "grad_failures": failures,
        "grads_checked": checked,
        "param_count": sum(1 for _ in generated.parameters()),
        "qkv_local_shape": list(qkv.to_local().shape),
    }
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    leave_after_barrier(dist)


if __name__ == "__main__":
    main()
