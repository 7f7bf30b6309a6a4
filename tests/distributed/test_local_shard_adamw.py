"""The run's AdamW (distributed/optimizer.py): torch's update on each parameter's local shard.
It steps what torch's AdamW cannot step with its multi-tensor kernels (plain tensors beside
DTensors of two meshes), gives the same bits as torch's AdamW on plain copies, keeps the
state DTensor-shaped (what checkpoints read) and takes a gradient placed otherwise than its
parameter (a pending partial sum)."""

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

from hyper_parallel.distributed.mesh import ParallelDims, build_device_mesh, build_expert_mesh
from hyper_parallel.distributed.optimizer import LocalShardAdamW, build_adamw


@pytest.fixture
def meshes(world_one_group):
    dims = ParallelDims()
    return build_device_mesh(dims, "cpu"), build_expert_mesh(dims, "cpu")


def _values(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=generator), torch.randn(5, generator=generator),
            torch.randn(2, 2, generator=generator)]


def test_mixed_meshes_step_as_torch_does_on_plain_tensors(meshes):
    mesh, experts = meshes
    start, grads = _values(0), _values(1)
    model = torch.nn.Module()
    model.plain = torch.nn.Parameter(start[0].clone())
    model.on_tp = torch.nn.Parameter(distribute_tensor(start[1].clone(), mesh["tp"], [Replicate()]))
    model.on_experts = torch.nn.Parameter(distribute_tensor(start[2].clone(), experts["ep"], [Replicate()]))
    ours = build_adamw(model.parameters(), lr=0.1, betas=(0.9, 0.95), weight_decay=0.1)
    copies = [torch.nn.Parameter(value.clone()) for value in start]
    torchs = torch.optim.AdamW(copies, lr=0.1, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for _ in range(3):
        for param, copy, grad in zip(model.parameters(), copies, grads, strict=True):
            param.grad = distribute_tensor(grad, param.device_mesh, param.placements) if isinstance(param, DTensor) \
                else grad.clone()
            copy.grad = grad.clone()
        ours.step()
        torchs.step()
    for param, copy in zip(model.parameters(), copies, strict=True):
        local = param.to_local() if isinstance(param, DTensor) else param
        assert torch.equal(local.detach(), copy.detach())
    state = ours.state[model.on_tp]
    assert isinstance(state["exp_avg"], DTensor) and state["exp_avg"].placements == model.on_tp.placements
    saved = get_optimizer_state_dict(model, ours)  # what the checkpointer saves
    assert set(saved["state"]) == {"plain", "on_tp", "on_experts"}
    assert isinstance(saved["state"]["on_experts"]["exp_avg_sq"], DTensor)


def test_a_pending_partial_gradient_is_placed_as_its_parameter(meshes):
    mesh, _ = meshes
    param = torch.nn.Parameter(distribute_tensor(torch.ones(3), mesh["tp"], [Replicate()]))
    optimizer = LocalShardAdamW([param], lr=0.5, weight_decay=0.0)
    param.grad = DTensor.from_local(torch.full((3,), 2.0), mesh["tp"], [Partial()])
    optimizer.step()
    # Adam's first step moves each element by lr against the gradient's sign (g / |g|)
    assert torch.allclose(param.to_local().detach(), torch.full((3,), 0.5))
