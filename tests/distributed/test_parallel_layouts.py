"""What the planner writes for SP, CP, loss parallel and EP on tiny qwen3_moe (no ranks
needed: the plan is data), and the expert mesh's rank layout."""

import pytest
import transformers
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.mesh import ParallelDims, expert_mesh_layout, mesh_layout
from hyper_parallel.distributed.plan_format import plan_modules_from_json, plan_modules_to_json
from hyper_parallel.planning.offline_mesh import build_offline_mesh
from hyper_parallel.planning.planner import PlanError, ShardingPlanner
from tests.distributed.conftest import build_meta_model
from tests.families.family_cases import FAMILY_CONFIGS

LAYER = "model.layers.1"


def plan_for(model, *, sp=False, loss_parallel=False, **sizes):
    dims = ParallelDims(**sizes)
    return ShardingPlanner(model, Layout(dims, sequence_parallel=sp, loss_parallel=loss_parallel)).plan()


def test_sequence_parallel_shards_the_residual_stream_and_gathers_around_blocks(meta_model):
    result = plan_for(meta_model, tp=2, sp=True)
    modules, roles = result.modules, result.roles
    seq = {"tp": Shard(1)}
    # the first layer takes its sequence piece; the embedding before it stays whole
    assert roles["model.layers.0"] == "sequence_split" and "model.layers.1" not in modules
    assert modules["model.layers.0"].in_src == ({"tp": Replicate()},)
    assert modules["model.layers.0"].in_dst == (seq,)
    assert modules["model.embed_tokens"].out_dst == ({"tp": Replicate()},)
    for norm in (f"{LAYER}.input_layernorm", f"{LAYER}.post_attention_layernorm", "model.norm"):
        assert modules[norm].in_src == modules[norm].in_dst == (seq,), norm
    attention = modules[f"{LAYER}.self_attn"]
    assert roles[f"{LAYER}.self_attn"] == "attention_block" and attention.local_map
    assert (attention.in_src, attention.in_dst) == ((seq,), ({"tp": Replicate()},))
    assert (attention.out_src, attention.out_dst) == (({"tp": Partial()}, None), (seq, None))  # reduce-scatter
    assert modules[f"{LAYER}.self_attn.o_proj"].out_dst == ({"tp": Partial()},)
    moe = modules[f"{LAYER}.mlp"]
    assert roles[f"{LAYER}.mlp"] == "moe_block"
    assert (moe.in_dst, moe.out_src, moe.out_dst) == (({"tp": Replicate()},), ({"tp": Partial()},), (seq,))
    assert modules[f"{LAYER}.mlp.experts"].out_dst == ({"tp": Partial()},)
    lm_head = modules["lm_head"]
    assert (lm_head.in_src, lm_head.in_dst, lm_head.out_dst) == ((seq,), ({"tp": Replicate()},),
                                                                 ({"tp": Replicate()},))


def test_sequence_parallel_reduces_inside_an_moe_block_with_a_gated_shared_expert():
    # Qwen2-MoE computes sigmoid(shared_expert_gate(x)) * shared_out in its own code: a partial
    # shared_out would leave the gate's gradient a partial sum, so the block reduces inside.
    config = transformers.AutoConfig.from_pretrained(FAMILY_CONFIGS / "qwen2_moe")
    modules = plan_for(build_meta_model(config), tp=2, sp=True).modules
    seq, replicated = {"tp": Shard(1)}, ({"tp": Replicate()},)
    block = modules[f"{LAYER}.mlp"]
    assert (block.out_src, block.out_dst) == (replicated, (seq,))  # a slice, no reduce-scatter
    assert modules[f"{LAYER}.mlp.experts"].out_dst == replicated
    assert modules[f"{LAYER}.mlp.shared_expert.down_proj"].out_dst == replicated
    assert modules[f"{LAYER}.mlp.shared_expert_gate"].state_shardings == {"weight": {"tp": Replicate()}}
    # the attention block in the same layer keeps its reduce-scatter
    assert modules[f"{LAYER}.self_attn"].out_src == ({"tp": Partial()}, None)


def test_loss_parallel_leaves_logits_vocab_sharded(meta_model):
    assert plan_for(meta_model, tp=2, loss_parallel=True).modules["lm_head"].out_dst == ({"tp": Shard(-1)},)


def test_context_parallel_splits_tokens_everywhere_but_inside_attention(meta_model):
    modules = plan_for(meta_model, tp=2, cp=2).modules
    residual = {"cp": Shard(1), "tp": Replicate()}
    assert modules["model.layers.0"].in_dst == (residual,)
    attention = modules[f"{LAYER}.self_attn"]
    assert attention.in_dst == ({"cp": Replicate(), "tp": Replicate()},)  # full K/V, mask and positions
    assert attention.out_dst == (residual, None)
    assert modules[f"{LAYER}.self_attn.q_norm"].in_dst == ({"tp": Shard(-2)},)  # sees the whole sequence
    tokens = {"cp": Shard(0)}  # the MoE block flattens [batch, seq] to tokens
    assert modules[f"{LAYER}.mlp.gate"].in_dst == (tokens,)
    assert modules[f"{LAYER}.mlp.experts"].in_dst == ({**tokens, "tp": Replicate()},) * 3
    assert modules["lm_head"].out_dst == ({"cp": Shard(1), "tp": Replicate()},)  # local logits -> sharded loss


def test_expert_parallel_shards_experts_on_dim0_and_keeps_the_router_replicated(meta_model):
    result = plan_for(meta_model, cp=2, tp=2, ep=2)
    experts = result.modules[f"{LAYER}.mlp.experts"]
    assert experts.state_shardings == {"gate_up_proj": {"tp": _StridedShard(1, split_factor=2), "ep": Shard(0)},
                                       "down_proj": {"tp": Shard(2), "ep": Shard(0)}}
    assert experts.in_dst == ({"tp": Replicate(), "ep": Shard(0)},) * 3  # ep replaces the cp token split
    assert experts.out_src == ({"tp": Partial(), "ep": Shard(0)},)
    assert result.modules[f"{LAYER}.mlp.gate"].state_shardings == {"weight": {"tp": Replicate()}}
    assert "ep" in result.applied_axes and "ep" not in result.recorded_axes


def test_every_layout_round_trips_through_the_plan_json(meta_model):
    result = plan_for(meta_model, tp=2, cp=2, ep=2, sp=True, loss_parallel=True)
    document = plan_modules_to_json(result.modules, result.roles)
    assert plan_modules_to_json(plan_modules_from_json(document), result.roles) == document
    assert document["model.layers.0.mlp.experts"]["state_shardings"]["down_proj"] == {"tp": "shard(2)",
                                                                                      "ep": "shard(0)"}


def test_expert_mesh_regroups_dp_cp_ranks():
    dims = ParallelDims(dp=2, cp=2, tp=2, ep=2)
    assert mesh_layout(dims) == (("pp", "dp", "cp", "tp"), (1, 2, 2, 2))
    assert expert_mesh_layout(dims) == (("pp", "edp", "ep", "tp"), (1, 2, 2, 2))
    assert expert_mesh_layout(ParallelDims(dp=2, cp=2, ep=4)) == (("pp", "edp", "ep", "tp"), (1, 1, 4, 1))
    assert build_offline_mesh(dims).size("ep") == 2


def test_experts_not_divisible_by_ep_is_a_plan_time_error(tiny_config):
    tiny_config.num_experts = 6
    with pytest.raises(PlanError, match=r"ep_size=4 does not divide config num_experts=6 "
                                        r"\(experts are split across ep ranks\)"):
        plan_for(build_meta_model(tiny_config), dp=2, cp=2, ep=4)


def test_sequence_layout_needs_decoder_layers():
    from torch import nn

    from hyper_parallel.planning.sequence_layout import apply_sequence_layout

    with pytest.raises(PlanError, match="Linear: sequence/context parallel needs the decoder layers"):
        apply_sequence_layout(nn.Linear(4, 4), {}, {}, Layout(ParallelDims(cp=2)))
