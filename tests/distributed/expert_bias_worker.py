"""torchrun worker (world 2, tp 2): packed experts with a bias on the down projection
(and on gate_up) against the same module in one process.

Run from the repo root::

    python -m torch.distributed.run --nproc_per_node=2 --standalone -m tests.distributed.expert_bias_worker --out DIR

For each layout of the experts (gate/up concatenated ``[E, 2I, H]``, HF's default; gate/up
interleaved and transposed ``[E, H, 2I]``, GPT-OSS's) a tiny MoE (a router linear with a
bias, top-2, then the experts) is planned with the ``packed_experts`` role, the plan goes
through its JSON form and the applier, and every rank writes ``DIR/rank<N>.json``: the
loss and every gradient (the input's too) against one process in fp32, the gradient norm,
the stored bias, and the loss after one AdamW step.
"""

import argparse
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.applier import apply_sharding_plan
from hyper_parallel.distributed.grad_norm import global_grad_norm
from hyper_parallel.distributed.mesh import MeshContext, ParallelDims, build_device_mesh
from hyper_parallel.distributed.plan_format import plan_modules_from_json, plan_modules_to_json
from hyper_parallel.planning.roles import packed_experts, replicate
from tests.rank_exit import leave_after_barrier

EXPERTS, HIDDEN, INTER, TOKENS, TOP_K = 4, 8, 6, 10, 2


class PackedExperts(nn.Module):
    """HF's packed experts, with biases, in either gate/up layout."""

    def __init__(self, *, concatenated: bool, transposed: bool):
        super().__init__()
        self.is_concatenated, self.is_transposed = concatenated, transposed
        gate_up = (EXPERTS, HIDDEN, 2 * INTER) if transposed else (EXPERTS, 2 * INTER, HIDDEN)
        down = (EXPERTS, INTER, HIDDEN) if transposed else (EXPERTS, HIDDEN, INTER)
        self.gate_up_proj = nn.Parameter(torch.randn(gate_up) * 0.5)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(EXPERTS, 2 * INTER) * 0.5)
        self.down_proj = nn.Parameter(torch.randn(down) * 0.5)
        self.down_proj_bias = nn.Parameter(torch.randn(EXPERTS, HIDDEN))

    def _project(self, x, weight):
        return x @ weight if self.is_transposed else x @ weight.transpose(0, 1)

    def forward(self, hidden, indices, weights):
        out = torch.zeros_like(hidden)
        for expert in range(EXPERTS):
            token, slot = torch.where(indices == expert)
            gate_up = self._project(hidden[token], self.gate_up_proj[expert]) + self.gate_up_proj_bias[expert]
            if self.is_concatenated:
                gate, up = gate_up.chunk(2, dim=-1)
            else:
                gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            down = self._project(F.silu(gate) * up, self.down_proj[expert]) + self.down_proj_bias[expert]
            out.index_add_(0, token, down * weights[token, slot, None])
        return out


class TinyMoe(nn.Module):
    def __init__(self, **layout):
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=True)
        self.experts = PackedExperts(**layout)

    def forward(self, hidden):
        top, indices = torch.topk(self.router(hidden), TOP_K, dim=-1)
        return self.experts(hidden, indices, torch.softmax(top, dim=-1))


def loss_of(model, hidden, target):
    return F.mse_loss(model(hidden), target)


def check_layout(name: str, layout: dict, mesh: MeshContext) -> dict:
    torch.manual_seed(0)
    reference = TinyMoe(**layout)
    parallel = TinyMoe(**layout)
    parallel.load_state_dict(reference.state_dict())
    plan = {"router": replicate(parallel.router, {}), "experts": packed_experts(parallel.experts, {})}
    roles = {"router": "replicate", "experts": "packed_experts"}
    frozen = plan_modules_from_json(json.loads(json.dumps(plan_modules_to_json(plan, roles))))
    apply_sharding_plan(parallel, frozen, mesh)

    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator)
    target = torch.randn(TOKENS, HIDDEN, generator=generator)
    ref_input, par_input = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    ref_loss = loss_of(reference, ref_input, target)
    ref_loss.backward()
    par_loss = loss_of(parallel, par_input, target)
    par_loss.backward()

    failures, checked = [], 0
    ref_params = dict(reference.named_parameters())
    for param_name, param in parallel.named_parameters():
        grad = param.grad
        if isinstance(grad, DTensor):
            if tuple(grad.placements) != tuple(param.placements):
                failures.append(f"{param_name}: grad placements {grad.placements} != {param.placements}")
            grad = grad.full_tensor()
        checked += 1
        if not torch.allclose(grad, ref_params[param_name].grad, rtol=1e-4, atol=1e-6):
            failures.append(f"{param_name}: max |diff| {(grad - ref_params[param_name].grad).abs().max().item():.3e}")
    if not torch.allclose(par_input.grad, ref_input.grad, rtol=1e-4, atol=1e-6):
        failures.append(f"input: max |diff| {(par_input.grad - ref_input.grad).abs().max().item():.3e}")

    bias = parallel.experts.down_proj_bias
    stored_whole = torch.equal(bias.to_local(), reference.experts.down_proj_bias.detach())
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    par_norm = global_grad_norm(list(parallel.parameters()))

    for model in (reference, parallel):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        after = {"reference": loss_of(reference, hidden, target).item(),
                 "parallel": loss_of(parallel, hidden, target).item()}
    return {
        "layout": name, "ref_loss": ref_loss.item(), "par_loss": par_loss.item(),
        "grad_failures": failures, "grads_checked": checked, "param_count": len(ref_params),
        "bias_replicated": all(p.is_replicate() for p in bias.placements),
        "bias_stored_whole": stored_whole,
        "grad_norm": {"reference": ref_norm, "parallel": par_norm},
        "loss_after_step": after,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dims = ParallelDims(tp=2)
    mesh = MeshContext(build_device_mesh(dims, "cpu"), Layout(dims))
    layouts = {"concatenated": {"concatenated": True, "transposed": False},
               "interleaved_transposed": {"concatenated": False, "transposed": True}}
    results = [check_layout(name, layout, mesh) for name, layout in layouts.items()]
    for result in results:
        assert not math.isnan(result["par_loss"])
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    leave_after_barrier(dist)


if __name__ == "__main__":
    main()
