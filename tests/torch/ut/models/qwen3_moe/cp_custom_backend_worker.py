"""torchrun worker: the custom-backend Qwen3-MoE (``models/common``) under context parallel
that splits attention, against the single-process HF model with the same weights.

Launched by test_custom_model_cp.py as ``-m tests.torch.ut.models.qwen3_moe.cp_custom_backend_worker
--out DIR VARIANT ...``; a variant is ``cp=2:tp=1:sp=0:lp=0:alg=allgather_kv:lb=1:tie=0:kv=2[:ep=2]``
(the world size is cp*tp; ``kv``: the kv heads; ``ep``: the routed experts split over ep,
which borrows the cp ranks; ``recipe=PATH``: parallelized as HyperAutoModel does, from
that recipe's accelerator section, which must say the same). For each variant every rank trains three AdamW steps on both
models and records the losses, every gradient that differs from the reference (first
step rtol 1e-4 / atol 1e-6; after AdamW steps, which amplify fp32 rounding, 1e-3 / 1e-5) and the
(heads, queries) its attention computed; it writes ``DIR/rank<N>.json``
(``{variant: {...}}``). A variant that raises is recorded with its error, so the others
still run and the test names the one that failed.
"""

import argparse
import json
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from hyper_parallel.config.layout import Layout
from hyper_parallel.config import load_training_config
from hyper_parallel.config.context_parallel import ContextParallel
from hyper_parallel.distributed.context_parallel import CONTEXT_ATTRIBUTE
from hyper_parallel.distributed.mesh import MeshContext, ParallelDims, build_device_mesh
from hyper_parallel.models.hf.model_builder import load_hf_tensors, parallelize_custom
from hyper_parallel.models.qwen3_moe import custom_model
from hyper_parallel.models.qwen3_moe.custom_model import build_custom_model, parallelize_custom_model
from tests.rank_exit import leave_after_barrier
from tests.torch.ut.models.qwen3_moe.tp_custom_backend_worker import custom_names, parallel_loss

CONFIG_DIR = "recipes/tiny_cpu/models/tiny-qwen3-moe"
BATCH, SEQ, STEPS, LR = 2, 16, 3, 1e-2


def hf_run(tie: bool, kv_heads: int) -> tuple[dict, torch.Tensor, torch.Tensor, list[float], list[dict]]:
    """The reference: initial state dict, the data, the losses and the gradients of each step."""
    config = AutoConfig.from_pretrained(CONFIG_DIR, tie_word_embeddings=tie, num_key_value_heads=kv_heads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    torch.manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    labels = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses, grads, names = [], [], custom_names(model)
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(ids).logits.flatten(0, 1), labels.flatten())
        loss.backward()
        losses.append(loss.item())
        grads.append({names[name]: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
    return {"config": config, "state": state}, ids, labels, losses, grads


def run_variant(flags: dict, reference) -> dict:
    dims = ParallelDims(cp=int(flags["cp"]), tp=int(flags["tp"]), ep=int(flags.get("ep", 1)))
    base, ids, labels, ref_losses, ref_grads = reference
    mesh = MeshContext(build_device_mesh(dims, "cpu"), Layout(dims))
    model = build_custom_model(base["config"])
    load_hf_tensors(model, base["config"], base["state"])
    if flags.get("recipe"):  # as HyperAutoModel does: the recipe's accelerator section decides
        config = load_training_config(flags["recipe"])
        parallelize_custom(custom_model, model, config, mesh)
    else:
        context_parallel = ContextParallel.effective(flags["alg"], flags["lb"] == "1", dims.cp)
        parallelize_custom_model(model, mesh, loss_parallel=flags["lp"] == "1", enable_sp=flags["sp"] == "1",
                                 context_parallel=context_parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses, mismatches = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        losses.append(parallel_loss(model, ids, labels, mesh.device_mesh["tp"], flags["lp"] == "1").item())
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            want = ref_grads[step][name]
            if isinstance(param, DTensor) and tuple(param.grad.placements) != tuple(param.placements):
                mismatches.append(f"step {step}: grad of {name} placed {param.grad.placements}, "
                                  f"the parameter {param.placements}")
            rtol, atol = (1e-4, 1e-6) if step == 0 else (1e-3, 1e-5)
            if grad is None or not torch.allclose(grad, want, rtol=rtol, atol=atol):
                diff = None if grad is None else (grad - want).abs().max().item()
                mismatches.append(f"step {step}: grad of {name} differs (max abs diff {diff})")
        optimizer.step()
    context = getattr(model.layers[0].attention.inner_attention, CONTEXT_ATTRIBUTE, None)
    experts = model.layers[0].moe.experts.gate_up_proj
    return {"local_experts": (experts.to_local() if isinstance(experts, DTensor) else experts).shape[0],"losses": losses, "reference_losses": ref_losses, "grad_mismatches": mismatches,
            "inner_shapes": sorted(context.inner_shapes) if context else None,
            "contexts": sum(hasattr(m, CONTEXT_ATTRIBUTE) for m in model.modules())}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("variants", nargs="+")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.use_deterministic_algorithms(True)
    references, results = {}, {}
    for variant in args.variants:
        flags = dict(item.split("=") for item in variant.split(":"))
        try:
            key = (flags["tie"], flags["kv"])
            if key not in references:
                references[key] = hf_run(flags["tie"] == "1", int(flags["kv"]))
            results[variant] = run_variant(flags, references[key])
        except Exception:  # recorded for the test to name; the other variants still run
            results[variant] = {"error": traceback.format_exc()[-3000:]}
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    leave_after_barrier(dist, 0)


if __name__ == "__main__":
    main()
