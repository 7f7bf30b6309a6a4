"""hyper_parallelize refuses a mesh other than the one its plan was made for, naming both,
before it shards anything (issue 13: the plan's recorded mesh is compared with the real one)."""

import dataclasses
import types

import pytest
import torch
from torch import nn

from hyper_parallel.runtime import PlanMeshError, check_plan_mesh, hyper_parallelize
from hyper_parallel.config.parallel_dims import ParallelDims
from hyper_parallel.distributed.mesh import MeshContext, mesh_layout
from hyper_parallel.distributed.plan_format import plan_to_json


def _plan(dims: ParallelDims) -> dict:
    axes, sizes = mesh_layout(dims)
    return plan_to_json(mesh_axes=axes, mesh_sizes=sizes, mesh_ep=dims.ep, applied_axes=["tp"], recorded_axes={},
                        modules={})


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4))


def test_a_mesh_context_of_other_sizes_is_refused_naming_both():
    model = _model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    context = MeshContext(device_mesh=None, dims=ParallelDims(dp=2))
    with pytest.raises(PlanMeshError) as caught:
        hyper_parallelize(model, context, _plan(ParallelDims(tp=2)))
    message = str(caught.value)
    assert "made for the mesh pp=1 dp=1 cp=1 tp=2 ep=1" in message, message
    assert "the mesh context is pp=1 dp=2 cp=1 tp=1 ep=1: dp, tp differ" in message, message
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # nothing sharded


def test_a_device_mesh_of_other_sizes_than_its_context_is_refused():
    device_mesh = types.SimpleNamespace(mesh_dim_names=("pp", "dp", "cp", "tp"), shape=(1, 1, 1, 2))
    context = MeshContext(device_mesh=device_mesh, dims=ParallelDims())
    with pytest.raises(PlanMeshError, match="the device mesh is pp=1 dp=1 cp=1 tp=2 ep=1: tp differs"):
        hyper_parallelize(_model(), context, _plan(ParallelDims()))



BUILT_FOR = ParallelDims(dp=4, ep=2)
OTHER_SIZE = {"dp": 2, "cp": 2, "tp": 2, "ep": 4, "pp": 2}  # each a valid layout beside BUILT_FOR's others


@pytest.mark.parametrize("axis", sorted(OTHER_SIZE))
def test_a_mesh_differing_in_any_one_axis_is_refused_naming_it(axis):
    """ep included: its ranks are borrowed from dp*cp, so the device mesh alone cannot tell
    a bundle built for ep 2 from one for ep 4; the plan records it."""
    mesh = dataclasses.replace(BUILT_FOR, **{axis: OTHER_SIZE[axis]})
    context = MeshContext(device_mesh=None, dims=mesh)
    with pytest.raises(PlanMeshError, match=rf"ep=\d+: {axis} differs;"):
        hyper_parallelize(_model(), context, _plan(BUILT_FOR))
    axes, sizes = mesh_layout(BUILT_FOR)
    check_plan_mesh(axes, sizes, MeshContext(device_mesh=None, dims=BUILT_FOR), ep=2)  # the same: taken


def test_a_plan_without_a_recorded_ep_size_is_taken_only_at_ep_1():
    plan = _plan(ParallelDims(dp=2))
    del plan["mesh"]["ep"]
    axes, sizes = mesh_layout(ParallelDims(dp=2))
    check_plan_mesh(axes, sizes, MeshContext(device_mesh=None, dims=ParallelDims(dp=2)), ep=None)
    with pytest.raises(PlanMeshError, match="ep differs .the plan records no ep size"):
        hyper_parallelize(_model(), MeshContext(device_mesh=None, dims=ParallelDims(dp=2, ep=2)), plan)
