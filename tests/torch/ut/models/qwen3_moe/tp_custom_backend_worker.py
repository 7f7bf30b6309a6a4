"""torchrun worker: the custom-backend Qwen3-MoE under tp (± sequence / loss parallel)
against the single-process HF model with the same weights.

Launched by test_custom_model_tp.py; every rank checks its own full gradients and exits
non-zero on a mismatch. Argument: comma-separated variants ``sp=0|1:lp=0|1``.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from transformers import AutoConfig, AutoModelForCausalLM

from hyper_parallel.distributed.weight_map import derive_weight_map
from hyper_parallel.models.hf.model_builder import hf_source_model, load_hf_tensors
from hyper_parallel.models.qwen3_moe.custom_model import build_custom_model, parallelize_custom_model
from tests.rank_exit import leave_after_barrier

CONFIG_DIR = "recipes/tiny_cpu/models/tiny-qwen3-moe"


def custom_names(hf_model) -> dict[str, str]:
    """HF parameter name → the custom model's, by the weight map the backend loads with."""
    custom = build_custom_model(hf_model.config, device="meta")
    shapes = {name: tensor.shape for name, tensor in hf_model.state_dict().items()}
    rules = derive_weight_map(custom, shapes, source_model=hf_source_model(hf_model.config))
    return {name: found[0].target for name, found in rules.items()}


def hf_reference(config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    labels = torch.randint(0, config.vocab_size, (2, 16))
    loss = F.cross_entropy(model(ids).logits.flatten(0, 1), labels.flatten())
    loss.backward()
    names = custom_names(model)
    grads = {names[name]: p.grad for name, p in model.named_parameters()}
    return model, ids, labels, loss.detach(), grads


def parallel_loss(model, ids, labels, mesh, loss_parallel_on: bool):
    logits = model(ids)
    if not loss_parallel_on:
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        return loss.detach()
    logits = DTensor.from_local(logits, mesh, [Shard(2)])
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
    return loss.detach().full_tensor()


def check_local_shapes(model, tp: int, where: str) -> list[str]:
    """The plan really split the tensor-parallel weights (not just replicated them)."""
    attention, experts = model.layers[0].attention, model.layers[0].moe.experts
    expected = {
        "tok_embeddings.weight": (model.tok_embeddings.weight, 0),
        "q_proj.weight": (attention.q_proj.weight, 0),
        "o_proj.weight": (attention.o_proj.weight, 1),
        "output.weight": (model.output.weight, 0),
        "experts.gate_up_proj": (experts.gate_up_proj, 1),  # this rank's slice of gate and of up
        "experts.down_proj": (experts.down_proj, 2),
    }
    errors = []
    for name, (param, dim) in expected.items():
        local = param.to_local().shape if isinstance(param, DTensor) else None
        want = list(param.shape)
        want[dim] //= tp
        if local is None or list(local) != want:
            errors.append(f"{where}: {name} local shape {local}, expected {tuple(want)}")
    return errors


def check_variant(hf_model, ids, labels, ref_loss, ref_grads, mesh, *, sp: bool, lp: bool) -> list[str]:
    model = build_custom_model(hf_model.config)
    load_hf_tensors(model, hf_model.config, hf_model.state_dict())
    parallelize_custom_model(model, mesh, loss_parallel=lp, enable_sp=sp)
    loss = parallel_loss(model, ids, labels, mesh, lp)
    errors = check_local_shapes(model, mesh.size(), f"sp={sp} lp={lp}")
    if not torch.allclose(loss, ref_loss, rtol=1e-5, atol=0):
        errors.append(f"sp={sp} lp={lp}: loss {loss.item()!r} != reference {ref_loss.item()!r}")
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        if grad is None or not torch.allclose(grad, ref_grads[name], rtol=1e-4, atol=1e-7):
            diff = None if grad is None else (grad - ref_grads[name]).abs().max().item()
            errors.append(f"sp={sp} lp={lp}: grad of {name} differs (max abs diff {diff})")
    return errors


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    hf_model, ids, labels, ref_loss, ref_grads = hf_reference(AutoConfig.from_pretrained(CONFIG_DIR))
    errors = []
    for variant in sys.argv[1].split(","):
        flags = dict(item.split("=") for item in variant.split(":"))
        errors += check_variant(hf_model, ids, labels, ref_loss, ref_grads, mesh,
                                sp=flags["sp"] == "1", lp=flags["lp"] == "1")
    for error in errors:
        print(f"[rank {rank}] {error}", flush=True)
    if not errors:
        print(f"[rank {rank}] OK {sys.argv[1]}", flush=True)
    leave_after_barrier(dist, 1 if errors else 0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
