"""Packed experts with a bias on the down projection (GPT-OSS's ``down_proj_bias``), and the
rest of GPT-OSS under the planner (interleaved gate/up, attention sinks).

The down projection of ``packed_experts`` is a partial sum over tp; its bias is placed
``partial`` (stored whole, added once: ``applier._partial_parameter``). Under torchrun
(world 2, tp 2) a tiny MoE matches one process in fp32: loss (rtol 1e-5), every gradient
and the input's (rtol 1e-4), the gradient norm, and the loss after an AdamW step."""

import json
import math

import pytest
import torch
import transformers
from torch.distributed.tensor import Partial, Replicate, Shard

from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.mesh import ParallelDims
from hyper_parallel.planning.planner import ShardingPlanner
from tests.launch import assert_ran, torchrun
from tests.project_fixtures import REPO

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

TP, CP = "tp", "cp"
TINY_GPT_OSS = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256,
                "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}


def test_tp2_expert_down_bias_matches_one_process(tmp_path):
    run = torchrun(["-m", "tests.distributed.expert_bias_worker", "--out", str(tmp_path)], cwd=REPO, timeout=300)
    assert_ran(run)
    for rank in (0, 1):
        for result in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            assert math.isclose(result["par_loss"], result["ref_loss"], rel_tol=1e-5), result
            assert result["grad_failures"] == [], result
            assert result["grads_checked"] == result["param_count"] == 6
            # what the optimizer, the checkpoint and the gradient norm see: the whole bias
            assert result["bias_replicated"] and result["bias_stored_whole"], result
            norm = result["grad_norm"]
            assert math.isclose(norm["parallel"], norm["reference"], rel_tol=1e-4), norm
            after = result["loss_after_step"]
            assert math.isclose(after["parallel"], after["reference"], rel_tol=1e-5), after


def _gpt_oss_plan(**dims):
    config = transformers.AutoConfig.for_model("gpt_oss", **TINY_GPT_OSS)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    sequence_parallel = dims.pop("sp", False)
    parallel = ParallelDims(**dims)
    return ShardingPlanner(model, Layout(parallel, sequence_parallel=sequence_parallel)).plan()


def test_gpt_oss_tp2_plan():
    result = _gpt_oss_plan(tp=2)
    experts = result.modules["model.layers.0.mlp.experts"]
    # [E, H, 2I] interleaved (gate_up[..., ::2]): a plain shard keeps whole gate/up pairs,
    # the same intermediate units as down_proj's shard
    assert experts.state_shardings == {"gate_up_proj": {TP: Shard(2)}, "gate_up_proj_bias": {TP: Shard(1)},
                                       "down_proj": {TP: Shard(1)}, "down_proj_bias": {TP: Partial()}}
    assert result.roles["model.layers.0.self_attn"] == "local_params"  # its sinks, split with the heads
    assert result.modules["model.layers.1.self_attn"].state_shardings == {"sinks": {TP: Shard(0)}}
    assert result.roles["model.layers.0.mlp.router"] == "replicate"


@pytest.mark.parametrize("dims", [{"cp": 2}, {"tp": 2, "sp": True}])
def test_gpt_oss_attention_block_keeps_its_sinks(dims):
    result = _gpt_oss_plan(**dims)
    attention = result.modules["model.layers.0.self_attn"]
    assert result.roles["model.layers.0.self_attn"] == "attention_block"
    assert attention.state_shardings == {"sinks": {TP: Shard(0)}}
    assert attention.in_dst[0][TP] == Replicate()
