"""Which models may take torch's multi-tensor AdamW (``foreach=None``): one kind of tensor
only, since DTensor refuses a foreach op over plain tensors and DTensors together, or over
DTensors of several meshes (tp and the expert mesh)."""

import torch
from torch.distributed.tensor import Replicate, distribute_tensor

from hyper_parallel.distributed.mesh import ParallelDims, build_device_mesh, build_expert_mesh
from hyper_parallel.trainer.base import _one_kind_of_tensor


def test_one_kind_of_tensor(world_one_group):
    dims = ParallelDims()
    mesh, experts = build_device_mesh(dims, "cpu"), build_expert_mesh(dims, "cpu")
    plain = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
    on_tp = [torch.nn.Parameter(distribute_tensor(torch.ones(2), mesh["tp"], [Replicate()])) for _ in range(2)]
    on_experts = torch.nn.Parameter(distribute_tensor(torch.ones(2), experts["ep"], [Replicate()]))
    assert _one_kind_of_tensor(plain) and _one_kind_of_tensor(on_tp)
    assert not _one_kind_of_tensor(plain + on_tp)  # plain and DTensor together
    assert not _one_kind_of_tensor([*on_tp, on_experts])  # two meshes
    optimizer = torch.optim.AdamW(on_tp, foreach=None)  # what the trainer builds for one mesh: it steps
    for param in on_tp:
        param.grad = torch.ones_like(param)
    optimizer.step()
