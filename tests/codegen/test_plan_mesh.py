"""hyper_parallelize refuses a run of another layout than the one its plan was made for,
naming the differing fields, before it shards anything: the plan document carries the
whole ``Layout`` and the mesh context carries the run's, and the two are compared as
values (every size, ep included, sp, loss parallel, the context-parallel setting)."""

import dataclasses
import types

import pytest
import torch
from torch import nn

from hyper_parallel.config.context_parallel import ContextParallel
from hyper_parallel.config.layout import Layout
from hyper_parallel.config.parallel_dims import ParallelDims
from hyper_parallel.config.pipeline import PipelineSettings
from hyper_parallel.distributed.mesh import MeshContext, mesh_layout
from hyper_parallel.distributed.plan_format import PlanFormatError, plan_from_json, plan_to_json
from hyper_parallel.runtime import PlanMeshError, check_plan_layout, hyper_parallelize


def _plan(layout: Layout) -> dict:
    return plan_to_json(layout=layout, applied_axes=["tp"], recorded_axes={}, modules={})


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4))


def test_a_mesh_context_of_other_sizes_is_refused_naming_both():
    model = _model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    context = MeshContext(device_mesh=None, layout=Layout(ParallelDims(dp=2)))
    with pytest.raises(PlanMeshError) as caught:
        hyper_parallelize(model, context, _plan(Layout(ParallelDims(tp=2))))
    message = str(caught.value)
    assert "made for dp=1 cp=1 tp=2 ep=1 pp=1 sequence_parallel=False loss_parallel=False" in message, message
    assert "is dp=2 cp=1 tp=1 ep=1 pp=1 sequence_parallel=False loss_parallel=False: dp, tp differ" in message, message
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # nothing sharded


def test_a_device_mesh_of_other_sizes_than_its_context_is_refused():
    device_mesh = types.SimpleNamespace(mesh_dim_names=("pp", "dp", "cp", "tp"), shape=(1, 1, 1, 2))
    context = MeshContext(device_mesh=device_mesh, layout=Layout())
    with pytest.raises(PlanMeshError, match="the device mesh is pp=1 dp=1 cp=1 tp=2: tp differs"):
        hyper_parallelize(_model(), context, _plan(Layout()))


def test_an_expert_mesh_of_another_ep_is_refused_naming_ep():
    built_for = Layout(ParallelDims(dp=4, ep=2))
    expert_mesh = types.SimpleNamespace(mesh_dim_names=("pp", "edp", "ep", "tp"), shape=(1, 1, 4, 1))
    context = MeshContext(device_mesh=None, layout=built_for, expert_mesh=expert_mesh)
    with pytest.raises(PlanMeshError, match="the expert mesh is pp=1 edp=1 ep=4 tp=1: edp, ep differ"):
        hyper_parallelize(_model(), context, _plan(built_for))


BUILT_FOR = Layout(ParallelDims(dp=4, cp=2, ep=2), sequence_parallel=False, loss_parallel=False,
                   context_parallel=ContextParallel("allgather_kv", True))
# Each a valid layout differing from BUILT_FOR in one field, named as the refusal names it.
ONE_FIELD_OTHER = {
    "dp": dataclasses.replace(BUILT_FOR, dims=dataclasses.replace(BUILT_FOR.dims, dp=2)),
    "cp": dataclasses.replace(BUILT_FOR, dims=dataclasses.replace(BUILT_FOR.dims, cp=4)),
    "tp": dataclasses.replace(BUILT_FOR, dims=dataclasses.replace(BUILT_FOR.dims, tp=2)),
    "ep": dataclasses.replace(BUILT_FOR, dims=dataclasses.replace(BUILT_FOR.dims, ep=4)),
    "pp": dataclasses.replace(BUILT_FOR, dims=dataclasses.replace(BUILT_FOR.dims, pp=2)),
    "sequence_parallel": dataclasses.replace(BUILT_FOR, sequence_parallel=True),
    "loss_parallel": dataclasses.replace(BUILT_FOR, loss_parallel=True),
    "context_parallel": dataclasses.replace(BUILT_FOR, context_parallel=ContextParallel("ulysses")),
}


@pytest.mark.parametrize("field", sorted(ONE_FIELD_OTHER))
def test_a_run_differing_in_any_one_field_is_refused_naming_it(field):
    """ep included: its ranks are borrowed from dp*cp, so the device mesh alone cannot tell
    a bundle built for ep 2 from one for ep 4; the plan's layout records it."""
    context = MeshContext(device_mesh=None, layout=ONE_FIELD_OTHER[field])
    with pytest.raises(PlanMeshError, match=rf": {field} differs;"):
        hyper_parallelize(_model(), context, _plan(BUILT_FOR))
    check_plan_layout(BUILT_FOR, MeshContext(device_mesh=None, layout=BUILT_FOR))  # the same: taken


def test_the_plan_document_carries_the_layout_whole():
    document = _plan(BUILT_FOR)
    assert plan_from_json(document).layout == BUILT_FOR
    assert plan_from_json(document).context_parallel == ContextParallel("allgather_kv", True)
    assert mesh_layout(plan_from_json(document).layout.dims)[1] == (1, 4, 2, 1)


def test_a_plan_of_the_earlier_format_is_refused_with_the_fix():
    earlier = {"format": 1, "mesh": {"axes": ["dp"], "sizes": [1], "ep": 1}, "applied_axes": [],
               "recorded_axes": {}, "modules": {}}
    with pytest.raises(PlanFormatError, match=r"format: expected 2, got 1 .*regenerate the bundle"):
        hyper_parallelize(_model(), MeshContext(device_mesh=None, layout=Layout()), earlier)


@pytest.mark.parametrize("bad, named", [
    ({"dp": 1, "cp": 1, "tp": 1, "ep": 1, "sequence_parallel": False, "loss_parallel": False}, "missing pp"),
    ({"dp": 1, "cp": 1, "tp": 1, "ep": 1, "pp": 1, "sequence_parallel": False, "loss_parallel": False,
      "fsdp": 2}, "unknown fsdp"),
    ({"dp": 2, "cp": 1, "tp": 1, "ep": 1, "pp": 1, "sequence_parallel": "yes", "loss_parallel": False},
     r"layout.sequence_parallel: expected true or false"),
    ({"dp": 2, "cp": 1, "tp": 1, "ep": 3, "pp": 1, "sequence_parallel": False, "loss_parallel": False},
     r"accelerator.ep_size: expected a divisor"),
])
def test_a_bad_written_layout_is_refused_naming_the_key(bad, named):
    document = {**_plan(Layout()), "layout": bad}
    with pytest.raises(PlanFormatError, match=named):
        plan_from_json(document)


def test_a_mesh_context_takes_a_layout_only():
    with pytest.raises(TypeError, match="MeshContext.layout: expected a Layout"):
        MeshContext(device_mesh=None, layout=ParallelDims(tp=2))


def test_the_layout_normalizes_its_context_parallel_setting():
    """At cp 1 there is nothing to split; ulysses has no load balance: layouts that split
    the same way are equal, and so sign and compare the same."""
    assert Layout(context_parallel=ContextParallel("allgather_kv", True)) == Layout()
    cp2 = ParallelDims(cp=2)
    assert Layout(cp2, context_parallel=ContextParallel("ulysses", True)) == Layout(
        cp2, context_parallel=ContextParallel("ulysses", False))


PP2 = Layout(ParallelDims(pp=2, tp=2))


def test_a_pipeline_layout_carries_its_stage_split_and_a_wrong_one_is_refused():
    document = plan_to_json(layout=PP2, applied_axes=["tp"], recorded_axes={}, modules={},
                            pipeline_stages=((0, 3), (3, 8)))
    assert document["pipeline"] == {"stages": [[0, 3], [3, 8]]}
    assert plan_from_json(document).pipeline_stages == ((0, 3), (3, 8))
    assert plan_from_json(_plan(Layout())).pipeline_stages is None
    for bad in ({"stages": [[0, 3]]}, {"stages": [[0, 3], [4, 8]]}, {"stages": [[1, 3], [3, 8]]},
                {"stages": [[0, 3], [3, 3]]}, {"stages": "0-3,3-8"}, None):
        broken = {**document, "pipeline": bad} if bad is not None else {k: v for k, v in document.items()
                                                                        if k != "pipeline"}
        with pytest.raises(PlanFormatError, match=r"plan.pipeline: expected \{'stages'.* with 2 contiguous"):
            plan_from_json(broken)


def test_the_pipeline_settings_are_part_of_the_layout():
    one = Layout(ParallelDims(pp=2), pipeline=PipelineSettings("gpipe"))
    other = Layout(ParallelDims(pp=2), pipeline=PipelineSettings("1f1b", (1,)))
    assert one.differences(other) == ["pipeline"]
    assert Layout.from_dict(other.as_dict(), where="w") == other
    assert other.as_dict()["pp_split_points"] == [1] and "pp_schedule" not in Layout().as_dict()
    assert Layout(pipeline=PipelineSettings("gpipe")) == Layout()  # nothing to split at pp 1
