"""Single-rank checks of the applier (the tp=2 numerics run under torchrun elsewhere)."""

import pytest
import torch
import transformers
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.applier import PlanApplyError, apply_sharding_plan
from hyper_parallel.distributed.mesh import MeshContext, ParallelDims, build_device_mesh
from hyper_parallel.distributed.plan_format import plan_modules_to_json
from hyper_parallel.planning.planner import ShardingPlanner
from tests.distributed.conftest import build_meta_model


@pytest.fixture(scope="module")
def mesh(world_one_group):
    return build_device_mesh(ParallelDims(), "cpu")


def _plan(model):
    dims = ParallelDims()
    return ShardingPlanner(model, Layout(dims)).plan().modules


def test_meta_model_gets_dtensor_parameters_on_the_tp_submesh(meta_model, mesh):
    apply_sharding_plan(meta_model, _plan(meta_model), mesh, single_rank_axes=True)
    experts = meta_model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, DTensor) and experts.gate_up_proj.is_meta
    assert experts.gate_up_proj.placements == (_StridedShard(1, split_factor=2),)
    assert experts.gate_up_proj.device_mesh.mesh_dim_names == ("tp",)
    assert meta_model.lm_head.weight.placements == (Shard(0),)
    # replicated with whole inputs and no conversion: nothing to place, the weight stays plain
    assert not isinstance(meta_model.model.norm.weight, DTensor)
    with pytest.raises(PlanApplyError, match=r"lm_head\.weight is already a DTensor"):
        apply_sharding_plan(meta_model, {"lm_head": _plan(build_meta_model(meta_model.config))["lm_head"]},
                            mesh, single_rank_axes=True)


def test_json_plan_with_globs_runs_like_the_plain_model(tiny_config, mesh):
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(tiny_config, attn_implementation="eager")
    parallel = transformers.AutoModelForCausalLM.from_config(tiny_config, attn_implementation="eager")
    parallel.load_state_dict(reference.state_dict())
    plan = plan_modules_to_json(_plan(parallel))
    plan = {key.replace(".0.", ".*.", 1) if ".1." not in key else key: entry for key, entry in plan.items()}
    apply_sharding_plan(parallel, plan, MeshContext(mesh, Layout(ParallelDims())), single_rank_axes=True)
    batch = torch.randint(0, tiny_config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))
    expected = reference(input_ids=batch, labels=batch).loss
    actual = parallel(input_ids=batch, labels=batch).loss
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=0)
    actual.backward()
    # local_map modules got their DTensor parameters back after running on local shards
    assert isinstance(parallel.model.layers[0].mlp.experts._parameters["down_proj"], DTensor)
    assert isinstance(parallel.model.layers[0].mlp.experts.down_proj.grad, DTensor)


@pytest.mark.parametrize("plan, message", [
    ({"model.layers.*.attn.q_proj": {"state_shardings": {}}}, r"plan key 'model\.layers\.\*\.attn\.q_proj' matches "
                                                              r"no module of Qwen3MoeForCausalLM"),
    ({"lm_head": {"state_shardings": {"weight": {"ep": "shard(0)"}}}}, r"plan entry 'lm_head' names the ep axis: "
                                                                       r"apply the plan with a MeshContext"),
    ({"lm_head": {"state_shardings": {"bias": {"tp": "shard(0)"}}}}, r"plan entry 'lm_head' shards 'bias', which "
                                                                     r"is not a parameter of Linear"),
    ({"lm_head": ["colwise"]}, r"plan\['lm_head'\]: expected a ShardingConfig or a mapping"),
])
def test_plans_that_do_not_fit_are_named(meta_model, mesh, plan, message):
    with pytest.raises((PlanApplyError, ValueError), match=message):
        apply_sharding_plan(meta_model, plan, mesh, single_rank_axes=True)
