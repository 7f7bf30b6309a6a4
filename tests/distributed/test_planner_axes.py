"""What a layout needs from the planner, and what it reports: a layout that splits no
module (dp, ep without tensor parallel) plans a model whose modules have no known role;
an axis is reported applied only when some entry places something on it; a model whose
forward computes its loss inline gets its logits gathered over cp, and loss parallel is
refused for it by recipe key. Planned on the remote-code fixtures, which use no HF names."""

from pathlib import Path

import pytest
import torch
import transformers
from torch.distributed.tensor import Replicate, Shard

from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.mesh import ParallelDims
from hyper_parallel.planning.planner import PlanError, ShardingPlanner

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "remote_code"


def _meta(name: str):
    config = transformers.AutoConfig.from_pretrained(FIXTURES / name, trust_remote_code=True)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=True)


def _plan(model, **dims):
    sp = dims.pop("sp", False)
    lp = dims.pop("loss_parallel", False)
    parallel = ParallelDims(**dims)
    return ShardingPlanner(model, Layout(parallel, sequence_parallel=sp, loss_parallel=lp)).plan()


UNCLASSIFIED = {"meta_reference": "layers.0.attention.wq", "fused_gqa": "decoder.blocks.0.attention.query_key_value",
                "list_moe": "backbone.pos_embed"}


@pytest.mark.parametrize("name", sorted(UNCLASSIFIED))
def test_data_parallel_plans_any_model_and_applies_no_axis(name):
    result = _plan(_meta(name), dp=2)
    assert result.roles[UNCLASSIFIED[name]] == "replicate"
    assert result.applied_axes == []


@pytest.mark.parametrize("name", ["meta_reference", "fused_gqa"])
def test_a_module_no_rule_classifies_leaves_its_part_of_every_layer_whole(name):
    # Names alone (no dataflow here) give wq / query_key_value no role at tp 2: the layer's
    # part holding it (attention) is replicated in every layer, which is exact at any tp,
    # rather than refused; the plan's notes name the part and the module.
    result = _plan(_meta(name), tp=2)
    part = "attention"
    assert f".{part}." in UNCLASSIFIED[name]
    inside = [fqn for fqn in result.roles if f".{part}." in f".{fqn}." and fqn.split(".")[-1] != part]
    assert inside and all(result.roles[fqn] == "replicate" for fqn in inside), result.roles
    assert any(f"*.{part} replicated whole over tp" in note for note in result.notes), result.notes


def test_a_module_no_rule_classifies_outside_the_layers_is_refused():
    with pytest.raises(PlanError, match="cannot classify module backbone.pos_embed"):
        _plan(_meta("list_moe"), tp=2)


def test_expert_parallel_over_a_module_list_is_not_reported_applied():
    """list_moe's experts are a ModuleList: nothing is placed on ep, so ep is not applied,
    and the plan records why (derive prints it)."""
    result = _plan(_meta("list_moe"), dp=2, ep=2)
    assert "ep" not in result.applied_axes, result.applied_axes
    assert "the ep ranks keep every expert" in result.recorded_axes["ep"], result.recorded_axes


def test_an_expert_count_in_a_nested_config_fits_expert_parallel():
    # DBRX keeps moe_num_experts in its ffn_config: ep 2 was refused for "no expert count";
    # its experts are no packed tensors, so ep is recorded as not applied instead.
    from hyper_parallel.testing.tiny_families import meta_model, tiny_config

    config = tiny_config("dbrx")
    result = _plan(meta_model(config), dp=2, ep=2)
    assert "ep" not in result.applied_axes and "ep" in result.recorded_axes
    config.ffn_config.moe_num_experts = 3
    with pytest.raises(PlanError, match=r"ep_size=2 does not divide config ffn_config.moe_num_experts=3"):
        _plan(meta_model(config), dp=2, ep=2)


def test_inline_loss_gets_logits_gathered_over_cp():
    result = _plan(_meta("fused_decoder"), cp=2)
    head = result.modules["lm_head"]
    assert isinstance(head.out_dst[0]["cp"], Replicate), head.out_dst
    assert "cp" in result.applied_axes


def test_a_loss_function_model_keeps_logits_split_over_cp():
    config = transformers.AutoConfig.from_pretrained(Path(__file__).resolve().parents[1] / "data/families/llama")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    head = _plan(model, cp=2).modules["lm_head"]
    assert head.out_dst[0]["cp"] == Shard(1), head.out_dst


def test_loss_parallel_is_refused_for_an_inline_loss():
    with pytest.raises(PlanError, match=r"accelerator.loss_parallel: FusedDecoderForCausalLM.forward computes its "
                                        r"loss itself.*set loss_parallel: false"):
        _plan(_meta("fused_decoder"), tp=2, sp=True, loss_parallel=True)


def test_expert_parallel_refuses_experts_it_cannot_number():
    # Longcat-Flash's experts have no num_experts, and their gate_up_proj holds rows for the
    # zero-compute experts that down_proj lacks: the token dispatch, which numbers experts by
    # num_experts along dim 0 of every weight, failed on the ranks; refused at derive now.
    from hyper_parallel.testing.tiny_families import meta_model, tiny_config

    with pytest.raises(PlanError, match=r"accelerator.ep_size: model.layers.0.mlp.experts \(LongcatFlashExperts\): "
                                        r"expert parallel numbers the experts by the module's num_experts.*"
                                        r"num_experts=None"):
        _plan(meta_model(tiny_config("longcat_flash")), dp=2, ep=2)
