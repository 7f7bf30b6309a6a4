"""merge_plan_overrides: the recipe's checked entries merged into a derived plan; what
is left to check needs the model (hits, types, parameter names)."""

import pytest
from torch.distributed.tensor import Replicate, Shard

from hyper_parallel.config.layout import Layout
from hyper_parallel.config.plan_override import PlanOverrideError, parse_plan_overrides
from hyper_parallel.distributed.mesh import ParallelDims
from hyper_parallel.planning.planner import PlanError, ShardingPlanner, merge_plan_overrides

TP = "tp"
LINEAR = "torch.nn.modules.linear.Linear"


def merge(derived, entries, model, **kwargs):
    """Merge recipe entries as the loader hands them on (parsed and checked)."""
    return merge_plan_overrides(derived, parse_plan_overrides(list(entries)), model, **kwargs)


@pytest.fixture
def derived(meta_model):
    dims = ParallelDims(tp=2)
    return ShardingPlanner(meta_model, Layout(dims)).plan().modules


def test_the_planner_merges_the_typed_entries_it_is_given(meta_model):
    dims = ParallelDims(tp=2, cp=2)
    overrides = parse_plan_overrides([{"match": "lm_head", "when": "cp", "out_dst": {"tp": "shard(-1)"}}])
    planner = ShardingPlanner(meta_model, Layout(dims), overrides=overrides)
    assert planner.plan().modules["lm_head"].out_dst == ({TP: Shard(-1)},)


def test_exact_fqn_merges_into_the_derived_entry(meta_model, derived):
    merged = merge(derived, [{
        "match": "lm_head", "out_dst": {"tp": "shard(-1)"}}], meta_model)
    assert merged["lm_head"].out_dst == ({TP: Shard(-1)},)
    assert merged["lm_head"].state_shardings == derived["lm_head"].state_shardings  # kept
    assert derived["lm_head"].out_dst == ({TP: Replicate()},)  # the input plan is not mutated


def test_glob_merges_into_every_match_and_module_type_narrows(meta_model, derived):
    merged = merge(derived, [{
        "match": "model.layers.*.self_attn.*", "module_type": LINEAR,
        "params": {"weight": {"tp": "replicate"}}}], meta_model)
    for layer in (0, 1):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert merged[f"model.layers.{layer}.self_attn.{name}"].state_shardings == {"weight": {TP: Replicate()}}
        assert merged[f"model.layers.{layer}.self_attn.q_norm"] == derived[f"model.layers.{layer}.self_attn.q_norm"]


def test_module_type_that_matches_nothing_is_an_error(meta_model, derived):
    with pytest.raises(PlanError, match=r"plan_overrides\[0\]: match 'lm_head' hits 1 module\(s\), none of "
                                        r"module_type 'torch.nn.modules.sparse.Embedding'"):
        merge(derived, [{"match": "lm_head", "module_type": "torch.nn.modules.sparse.Embedding",
                                        "params": {}}], meta_model)


def test_match_that_hits_no_module_names_the_pattern(meta_model, derived):
    with pytest.raises(PlanError, match=r"plan_overrides\[1\]: match 'model\.layers\.\*\.attn\.q_proj' "
                                        r"hits no module of Qwen3MoeForCausalLM"):
        merge(derived, [{"match": "lm_head", "replace_module": {"_target_": "hyper_parallel.x.y"}},
                                       {"match": "model.layers.*.attn.q_proj", "params": {}}], meta_model)


def test_module_without_derived_entry_must_be_fully_specified(meta_model, derived):
    partial_plan = {k: v for k, v in derived.items() if k != "model.norm"}
    with pytest.raises(PlanError, match=r"module 'model\.norm' has no derived plan entry, so the override must be "
                                        r"fully specified; 'params' lacks \['weight'\]"):
        merge(partial_plan, [{"match": "model.norm", "local_map": True}], meta_model)
    merged = merge(partial_plan, [{
        "match": "model.norm", "params": {"weight": {"tp": "replicate"}}, "local_map": True}], meta_model)
    assert merged["model.norm"].state_shardings == {"weight": {TP: Replicate()}} and merged["model.norm"].local_map
    # a module with no parameters of its own is fully specified by its IO alone
    merged = merge(derived, [{"match": "model.layers.0.mlp", "in_src": [{"tp": "replicate"}]}],
                                  meta_model)
    assert merged["model.layers.0.mlp"].in_src == ({TP: Replicate()},)


def test_when_skips_inactive_forms_and_needs_active_axes(meta_model, derived):
    entry = {"match": "lm_head", "when": "cp", "out_dst": {"tp": "shard(-1)"}}
    assert merge(derived, [entry], meta_model, active_axes={"tp"}) == derived
    merged = merge(derived, [entry], meta_model, active_axes=ParallelDims(tp=2, cp=2).active_axes())
    assert merged["lm_head"].out_dst == ({TP: Shard(-1)},)
    with pytest.raises(PlanError, match=r"has when='cp' but no active parallel forms were given"):
        merge(derived, [entry], meta_model)
    with pytest.raises(PlanOverrideError, match=r"plan_overrides\[0\]\.when: expected one of tp, cp, ep, sp"):
        merge(derived, [{**entry, "when": "dp"}], meta_model, active_axes={"tp"})


def test_replace_module_only_leaves_the_plan_alone(meta_model, derived):
    entry = {"match": "model.layers.*.mlp.experts", "replace_module": {"_target_": "hyper_parallel.pkg.GroupedExperts"}}
    assert merge(derived, [entry], meta_model) == derived


def test_replace_module_type_names_the_replaced_module_not_the_replacement(meta_model, derived):
    """A replace_module entry's module_type is checked when replacing; the planner sees the
    replacement, so the type does not narrow its placements."""
    merged = merge(derived, [{"match": "lm_head", "module_type": "some.Replaced", "out_dst": {"tp": "shard(-1)"},
                              "replace_module": {"_target_": "hyper_parallel.x.y"}}], meta_model)
    assert merged["lm_head"].out_dst == ({TP: Shard(-1)},)


def test_exact_type_narrows_to_the_class_itself(meta_model, derived):
    entry = {"match": "lm_head", "module_type": LINEAR, "exact_type": True, "out_dst": {"tp": "shard(-1)"}}
    assert merge(derived, [entry], meta_model)["lm_head"].out_dst == ({TP: Shard(-1)},)
    with pytest.raises(PlanError, match=r"none of exact module_type 'torch\.nn\.modules\.module\.Module'"):
        merge(derived, [{**entry, "module_type": "torch.nn.modules.module.Module"}], meta_model)
    # without exact_type a base class matches
    assert merge(derived, [{**entry, "module_type": "torch.nn.modules.module.Module", "exact_type": False}],
                 meta_model)["lm_head"].out_dst == ({TP: Shard(-1)},)


def test_a_parameter_the_module_lacks_is_named(meta_model, derived):
    with pytest.raises(PlanError, match=r"'bias' is not a direct parameter of 'lm_head'"):
        merge(derived, [{"match": "lm_head", "params": {"bias": {"tp": "shard(0)"}}}], meta_model)


@pytest.mark.parametrize("entry, message", [
    ({"match": "lm_head", "colour": "red"}, r"unknown key 'plan_overrides\[0\]\.colour'"),
    ({"params": {}}, r"missing required key 'plan_overrides\[0\]\.match'"),
    ({"match": "lm_head", "params": {"weight": {"tp": "rows"}}}, r"params\.weight\.tp: unknown placement 'rows'"),
    ({"match": "lm_head", "params": {"weight": {"xx": "shard(0)"}}}, r"unknown mesh axis 'xx'"),
    ({"match": "lm_head", "in_src": "replicate"}, r"in_src: expected a mapping or a list of mappings"),
    ({"match": "lm_head", "local_map": "yes"}, r"local_map: expected bool, got str 'yes'"),
])
def test_malformed_entries_never_reach_the_merge(entry, message):
    with pytest.raises(PlanOverrideError, match=message):
        parse_plan_overrides([entry])
