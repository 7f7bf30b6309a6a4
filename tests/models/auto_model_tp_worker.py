"""torchrun worker (world 2, tp 2): HyperAutoModel.from_pretrained with a mesh, per
backend, against the single-process HF model on the same saved weights.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.models.auto_model_tp_worker \
        --recipe R.yaml --workspace W --out OUT_DIR --backends gen,hf,custom

Writes ``OUT_DIR/rank<N>.json``: per backend the model class's module, the loss, the
reference loss and (for the HF-shaped backends) the gradients that differ.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

from hyper_parallel.config.layout import Layout
from hyper_parallel.config import load_training_config
from hyper_parallel.distributed.mesh import MeshContext, ParallelDims, build_device_mesh
from hyper_parallel.models.hf import HyperAutoModel
from tests.rank_exit import leave_after_barrier


def causal_lm_loss(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """HF's ForCausalLM loss: predict token t+1 from position t, mean over positions."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             batch[:, 1:].reshape(-1))


def loss_of(model, batch: torch.Tensor) -> torch.Tensor:
    out = model(batch)
    return causal_lm_loss(out.logits if hasattr(out, "logits") else out, batch)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def grad_mismatches(model, reference) -> tuple[list[str], int]:
    expected = dict(reference.named_parameters())
    failures, checked = [], 0
    for name, param in model.named_parameters():
        want = expected[name].grad
        got = full(param.grad)
        checked += 1
        if got is None or not torch.allclose(got, want, rtol=1e-4, atol=1e-6):
            failures.append(name)
    return failures, checked


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--recipe", "--workspace", "--out", "--backends"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()

    dims = ParallelDims(tp=2)
    context = MeshContext(build_device_mesh(dims, "cpu"), Layout(dims))
    base = load_training_config(args.recipe)
    model_dir = Path(args.recipe).parent / base.model.pretrained_model_name_or_path
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    batch = torch.randint(0, reference.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(11))
    ref_loss = loss_of(reference, batch)
    ref_loss.backward()

    results = {"rank": dist.get_rank(), "ref_loss": ref_loss.item()}
    for backend in args.backends.split(","):
        config = load_training_config(args.recipe)
        config.modeling_backend = backend
        model = HyperAutoModel.from_pretrained(config, mesh_context=context, workspace_root=args.workspace,
                                               timeout_s=300)
        loss = loss_of(model, batch)
        loss.backward()
        entry = {"class_module": type(model).__module__, "loss": loss.item(),
                 "experts": type(model.model.layers[0].mlp.experts).__name__ if backend != "custom" else None,
                 "dtensor_params": sum(isinstance(p, DTensor) for p in model.parameters())}
        if backend != "custom":  # the custom model has its own parameter names
            entry["grad_failures"], entry["grads_checked"] = grad_mismatches(model, reference)
        results[backend] = entry
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    leave_after_barrier(dist)


if __name__ == "__main__":
    main()
