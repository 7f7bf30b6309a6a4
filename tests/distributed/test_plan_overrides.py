import pytest
from torch.distributed.tensor import Replicate, Shard

from hyper_parallel.distributed.mesh import ParallelDims, build_offline_mesh
from hyper_parallel.distributed.planner import PlanError, ShardingPlanner, merge_plan_overrides

TP = "tp"
LINEAR = "torch.nn.modules.linear.Linear"


@pytest.fixture
def derived(meta_model):
    dims = ParallelDims(tp=2)
    return ShardingPlanner(meta_model, dims=dims, mesh=build_offline_mesh(dims)).plan().modules


def test_exact_fqn_merges_into_the_derived_entry(meta_model, derived):
    merged = merge_plan_overrides(derived, [{
        "match": "lm_head", "out_dst": {"tp": "shard(-1)"}}], meta_model)
    assert merged["lm_head"].out_dst == ({TP: Shard(-1)},)
    assert merged["lm_head"].state_shardings == derived["lm_head"].state_shardings  # kept
    assert derived["lm_head"].out_dst == ({TP: Replicate()},)  # the input plan is not mutated


def test_glob_merges_into_every_match_and_module_type_narrows(meta_model, derived):
    merged = merge_plan_overrides(derived, [{
        "match": "model.layers.*.self_attn.*", "module_type": LINEAR,
        "params": {"weight": {"tp": "replicate"}}}], meta_model)
    for layer in (0, 1):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert merged[f"model.layers.{layer}.self_attn.{name}"].state_shardings == {"weight": {TP: Replicate()}}
        assert merged[f"model.layers.{layer}.self_attn.q_norm"] == derived[f"model.layers.{layer}.self_attn.q_norm"]


def test_module_type_that_matches_nothing_is_an_error(meta_model, derived):
    with pytest.raises(PlanError, match=r"plan_overrides\[0\]: match 'lm_head' hits 1 module\(s\), none of "
                                        r"module_type 'torch.nn.modules.sparse.Embedding'"):
        merge_plan_overrides(derived, [{"match": "lm_head", "module_type": "torch.nn.modules.sparse.Embedding",
                                        "params": {}}], meta_model)


def test_match_that_hits_no_module_names_the_pattern(meta_model, derived):
    with pytest.raises(PlanError, match=r"plan_overrides\[1\]: match 'model\.layers\.\*\.attn\.q_proj' "
                                        r"hits no module of Qwen3MoeForCausalLM"):
        merge_plan_overrides(derived, [{"match": "lm_head", "replace_module": {"_target_": "x.y"}},
                                       {"match": "model.layers.*.attn.q_proj", "params": {}}], meta_model)


def test_module_without_derived_entry_must_be_fully_specified(meta_model, derived):
    partial_plan = {k: v for k, v in derived.items() if k != "model.norm"}
    with pytest.raises(PlanError, match=r"module 'model\.norm' has no derived plan entry, so the override must be "
                                        r"fully specified; 'params' lacks \['weight'\]"):
        merge_plan_overrides(partial_plan, [{"match": "model.norm", "local_map": True}], meta_model)
    merged = merge_plan_overrides(partial_plan, [{
        "match": "model.norm", "params": {"weight": {"tp": "replicate"}}, "local_map": True}], meta_model)
    assert merged["model.norm"].state_shardings == {"weight": {TP: Replicate()}} and merged["model.norm"].local_map
    # a module with no parameters of its own is fully specified by its IO alone
    merged = merge_plan_overrides(derived, [{"match": "model.layers.0.mlp", "in_src": [{"tp": "replicate"}]}],
                                  meta_model)
    assert merged["model.layers.0.mlp"].in_src == ({TP: Replicate()},)


def test_when_skips_inactive_forms_and_needs_active_axes(meta_model, derived):
    entry = {"match": "lm_head", "when": "cp", "out_dst": {"tp": "shard(-1)"}}
    assert merge_plan_overrides(derived, [entry], meta_model, active_axes={"tp"}) == derived
    merged = merge_plan_overrides(derived, [entry], meta_model, active_axes=ParallelDims(tp=2, cp=2).active_axes())
    assert merged["lm_head"].out_dst == ({TP: Shard(-1)},)
    with pytest.raises(PlanError, match=r"has when='cp' but no active parallel forms were given"):
        merge_plan_overrides(derived, [entry], meta_model)
    with pytest.raises(PlanError, match=r"when='dp'; expected one of cp, ep, tp, sp"):
        merge_plan_overrides(derived, [{**entry, "when": "dp"}], meta_model, active_axes={"tp"})


def test_replace_module_only_leaves_the_plan_alone(meta_model, derived):
    entry = {"match": "model.layers.*.mlp.experts", "replace_module": {"_target_": "pkg.GroupedExperts"}}
    assert merge_plan_overrides(derived, [entry], meta_model) == derived


@pytest.mark.parametrize("entry, message", [
    ({"match": "lm_head", "colour": "red"}, r"unknown keys \['colour'\]"),
    ({"params": {}}, "'match' must be a module FQN or glob"),
    ({"match": "lm_head", "params": {"bias": {"tp": "shard(0)"}}}, r"'bias' is not a direct parameter of 'lm_head'"),
    ({"match": "lm_head", "params": {"weight": {"tp": "rows"}}}, r"params\.weight: unknown placement 'rows'"),
    ({"match": "lm_head", "params": {"weight": {"xx": "shard(0)"}}}, r"unknown mesh axis 'xx'"),
    ({"match": "lm_head", "in_src": "replicate"}, r"in_src: expected null, a named placement or a list"),
    ({"match": "lm_head", "local_map": "yes"}, r"local_map: expected true or false"),
])
def test_malformed_entries_are_named(meta_model, derived, entry, message):
    with pytest.raises(PlanError, match=message):
        merge_plan_overrides(derived, [entry], meta_model)
