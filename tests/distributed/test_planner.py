import pytest
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.mesh import ParallelDims
from hyper_parallel.planning.offline_mesh import OfflineMesh, build_offline_mesh
from hyper_parallel.planning.plan_lint import lint_plan
from hyper_parallel.planning.planner import PlanError, ShardingPlanner
from hyper_parallel.protocols.sharding import ShardingConfig
from tests.distributed.conftest import build_meta_model

TP = "tp"


def plan_for(model, **dims):
    parallel = ParallelDims(**dims)
    return ShardingPlanner(model, Layout(parallel)).plan()


def test_roles_and_placements_of_tiny_qwen3_moe(meta_model):
    result = plan_for(meta_model, tp=2)
    roles = result.roles
    assert roles["model.embed_tokens"] == "vocab_embedding"
    assert [roles[f"model.layers.0.self_attn.{n}"] for n in ("q_proj", "k_proj", "v_proj", "o_proj")] == \
        ["colwise", "colwise", "colwise", "rowwise"]
    assert roles["model.layers.1.self_attn.q_norm"] == roles["model.layers.1.self_attn.k_norm"] == "head_norm"
    assert roles["model.layers.0.mlp.experts"] == "packed_experts"
    assert roles["model.layers.0.mlp.gate"] == roles["model.norm"] == "replicate"
    assert roles["lm_head"] == "lm_head"
    modules = result.modules
    experts = modules["model.layers.0.mlp.experts"]
    assert experts.state_shardings == {"gate_up_proj": {TP: _StridedShard(1, split_factor=2)},
                                       "down_proj": {TP: Shard(2)}}
    assert experts.local_map and experts.out_src == ({TP: Partial()},) and experts.out_dst == ({TP: Replicate()},)
    assert modules["model.layers.0.self_attn.o_proj"].state_shardings == {"weight": {TP: Shard(1)}}
    assert modules["lm_head"].out_dst == ({TP: Replicate()},)
    assert modules["model.layers.0.self_attn.q_norm"].in_dst == ({TP: Shard(-2)},)
    assert set(modules) == {name.rpartition(".")[0] for name, _ in meta_model.named_parameters()}
    assert all(p.is_meta for p in meta_model.parameters())  # planning left the model alone


def test_structure_alone_gives_the_same_plan(meta_model):
    hinted = plan_for(meta_model, tp=2)
    meta_model._tp_plan = {}
    meta_model.config.base_model_tp_plan = {}
    structural = plan_for(meta_model, tp=2)
    assert structural.roles == hinted.roles
    assert structural.modules == hinted.modules


def test_user_hints_win_over_the_model_plan(meta_model):
    # The model's plan says colwise for q/k/v; the user's gathers them (a hint is used where
    # it agrees with the structure: tests/distributed/test_planner_styles.py).
    dims = ParallelDims(tp=2)
    gathered = {f"model.layers.*.self_attn.{name}": "colwise_gather_output" for name in ("q_proj", "k_proj", "v_proj")}
    result = ShardingPlanner(meta_model, Layout(dims), hints=gathered).plan()
    assert result.roles["model.layers.1.self_attn.q_proj"] == "colwise_gathered"


def test_applied_and_recorded_axes(meta_model):
    dims = ParallelDims(tp=2, cp=2, ep=2, dp=2, pp=2)
    result = ShardingPlanner(meta_model, Layout(dims, sequence_parallel=True, loss_parallel=True)).plan()
    assert dims.world_size == 16
    assert result.applied_axes == ["tp", "cp", "ep", "loss_parallel", "sp"]
    assert set(result.recorded_axes) == {"dp", "pp"}
    assert "FSDP2" in result.recorded_axes["dp"]


@pytest.mark.parametrize("overrides, dims, message", [
    ({}, {"tp": 3}, "tp_size=3 does not divide config num_attention_heads=4"),
    ({}, {"tp": 4}, "tp_size=4 does not divide config num_key_value_heads=2"),
    ({"intermediate_size": 129}, {"tp": 2}, "tp_size=2 does not divide config intermediate_size=129"),
    ({"moe_intermediate_size": 33}, {"tp": 2}, "tp_size=2 does not divide config moe_intermediate_size=33"),
    ({"vocab_size": 255}, {"tp": 2}, "tp_size=2 does not divide config vocab_size=255"),
    ({}, {"dp": 3, "ep": 3}, "ep_size=3 does not divide config num_experts=4"),
])
def test_config_divisibility_lints(tiny_config, overrides, dims, message):
    for key, value in overrides.items():
        setattr(tiny_config, key, value)
    model = build_meta_model(tiny_config)
    with pytest.raises(PlanError, match=message):
        plan_for(model, **dims)


def test_mesh_must_match_dims(meta_model):
    with pytest.raises(PlanError, match="does not match tp_size=2"):
        ShardingPlanner(meta_model, Layout(ParallelDims(tp=2)), mesh=build_offline_mesh(ParallelDims())).plan()


def _tp3_mesh():
    return OfflineMesh(("pp", "dp", "cp", "tp"), (1, 1, 1, 3))


def test_lint_shard_must_divide_the_parameter_dim(meta_model):
    modules = plan_for(meta_model, tp=1).modules  # vocab 256 rows, sharded over 3 ranks
    with pytest.raises(PlanError, match=r"parameter model\.embed_tokens\.weight: shard\(0\) over tp=3 needs dim 0 "
                                        r"\(size 256\) divisible by 3"):
        lint_plan(meta_model, modules, _tp3_mesh())


def test_lint_packed_shard_counts_the_blocks(meta_model):
    modules = dict(plan_for(meta_model, tp=1).modules)
    modules["model.layers.0.mlp.experts"].state_shardings["down_proj"] = {TP: _StridedShard(2, split_factor=3)}
    with pytest.raises(PlanError, match=r"experts\.down_proj: packed_shard\(2,3\) over tp=1 x 3 packed blocks "
                                        r"needs dim 2 \(size 32\) divisible by 3"):
        lint_plan(meta_model, modules, build_offline_mesh(ParallelDims()))


def test_lint_every_trainable_parameter_is_covered(meta_model):
    modules = dict(plan_for(meta_model, tp=2).modules)
    del modules["model.layers.1.post_attention_layernorm"]
    with pytest.raises(PlanError, match=r"trainable parameter model\.layers\.1\.post_attention_layernorm\.weight "
                                        r"\(Qwen3MoeRMSNorm, shape \[64\]\) is not covered"):
        lint_plan(meta_model, modules, build_offline_mesh(ParallelDims(tp=2)))


def test_lint_entry_must_name_direct_parameters(meta_model):
    modules = dict(plan_for(meta_model, tp=2).modules)
    modules["model.norm"] = ShardingConfig(state_shardings={"bias": {TP: Replicate()}})
    with pytest.raises(PlanError, match=r"plan entry 'model\.norm' shards 'bias', which is not a parameter or buffer"):
        lint_plan(meta_model, modules, build_offline_mesh(ParallelDims(tp=2)))


def test_lint_module_covered_by_exactly_one_entry(meta_model):
    derived = plan_for(meta_model, tp=2).modules
    modules = {**derived, "model.layers.*.input_layernorm": derived["model.norm"]}
    with pytest.raises(PlanError, match=r"module 'model\.layers\.0\.input_layernorm' is covered by two plan "
                                        r"entries: 'model\.layers\.0\.input_layernorm' and 'model\.layers\.\*"):
        lint_plan(meta_model, modules, build_offline_mesh(ParallelDims(tp=2)))
    with pytest.raises(PlanError, match=r"plan key 'model\.blocks\.\*' matches no module"):
        lint_plan(meta_model, {**derived, "model.blocks.*": derived["model.norm"]},
                  build_offline_mesh(ParallelDims(tp=2)))


def test_lint_tied_parameters_must_agree(tiny_config):
    tiny_config.tie_word_embeddings = True
    model = build_meta_model(tiny_config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    modules = dict(plan_for(model, tp=2).modules)  # both vocab-sharded: agrees
    modules["lm_head"] = ShardingConfig(state_shardings={"weight": {TP: Shard(1)}})
    with pytest.raises(PlanError, match=r"tied parameters model\.embed_tokens\.weight and lm_head\.weight have "
                                        r"different placements"):
        lint_plan(model, modules, build_offline_mesh(ParallelDims(tp=2)))
