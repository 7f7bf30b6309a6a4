"""The declarative helpers write exactly the expected ShardingConfig into every
sub-module config of a Decoder (written out literally here, not recomputed)."""

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.models.common import (
    SharedExpertMoE,
    colwise_config,
    dense_activation_placement,
    dense_param_placement,
    norm_config,
    rowwise_config,
    set_decoder_sharding_config,
    set_dense_ffn_sharding,
    set_gqa_attention_sharding,
    set_qkv_linear_sharding,
)
from hyper_parallel.models.common.attention import GQAttention
from hyper_parallel.protocols import Function, MeshAxisName, Module, ShardingConfig

TP, CP = MeshAxisName.TP, MeshAxisName.CP
R, P = {TP: Replicate()}, {TP: Partial()}


def tp(placement):
    return {TP: placement}


def colwise(*, src=R, dst=tp(Shard(-1))):
    return ShardingConfig(state_shardings={"weight": tp(Shard(0))}, in_src=src, in_dst=R,
                          out_src=tp(Shard(-1)), out_dst=dst)


def rowwise(out):
    return ShardingConfig(state_shardings={"weight": tp(Shard(1))}, in_src=tp(Shard(-1)), in_dst=tp(Shard(-1)),
                          out_src=P, out_dst=out)


def replicated_weight(io):
    return ShardingConfig(state_shardings={"weight": R}, in_src=io, in_dst=io, out_src=io, out_dst=io)


def expected_plan(*, loss_parallel: bool, enable_sp: bool) -> dict[str, ShardingConfig | None]:
    x = tp(Shard(1)) if enable_sp else R
    heads = tp(Shard(1))
    plan = {
        "": None,
        "tok_embeddings": ShardingConfig(state_shardings={"weight": tp(Shard(0))}, in_src=R, in_dst=R,
                                         out_src=P, out_dst=x),
        "rope": None,
        "norm": replicated_weight(x),
        "output": colwise(src=x, dst=tp(Shard(-1)) if loss_parallel else R),
    }
    for i in (0, 1):
        layer = f"layers.{i}"
        plan.update({
            layer: None,
            f"{layer}.attention_norm": replicated_weight(x),
            f"{layer}.ffn_norm": replicated_weight(x),
            f"{layer}.attention": ShardingConfig(in_src=(x, None, None), in_dst=(R, None, None)),
            f"{layer}.attention.q_proj": colwise(),
            f"{layer}.attention.k_proj": colwise(),
            f"{layer}.attention.v_proj": colwise(),
            f"{layer}.attention.o_proj": rowwise(x),
            f"{layer}.attention.q_norm": replicated_weight(tp(Shard(2))),
            f"{layer}.attention.k_norm": replicated_weight(tp(Shard(2))),
            f"{layer}.attention.inner_attention": ShardingConfig(
                in_src=(heads, heads, heads, None, None), in_dst=(heads, heads, heads, None, None),
                out_src=tp(Shard(2)), out_dst=tp(Shard(2)), local_map=True),
        })
    plan.update({
        "layers.0.feed_forward": ShardingConfig(in_src=x, in_dst=R),
        "layers.0.feed_forward.w1": colwise(),
        "layers.0.feed_forward.w3": colwise(),
        "layers.0.feed_forward.w2": rowwise(x),
        "layers.1.moe": ShardingConfig(in_src=x, in_dst=R, out_src=R, out_dst=x),
        "layers.1.moe.router": ShardingConfig(state_shardings={"weight": R}, in_src=R, in_dst=R,
                                              out_src=(R, R, R), out_dst=(R, R, R), local_map=True),
        # each rank: its slice of the intermediate dim in gate and up, and in down
        "layers.1.moe.experts": ShardingConfig(
            state_shardings={"gate_up_proj": tp(_StridedShard(1, split_factor=2)), "down_proj": tp(Shard(2))},
            in_src=(R, R, R), in_dst=(R, R, R), out_src=tp(Partial()), out_dst=R, local_map=True),
    })
    return plan


@pytest.mark.parametrize("loss_parallel, enable_sp", [(True, False), (False, True)])
def test_every_sub_module_gets_exactly_the_expected_sharding(two_layer_config, loss_parallel, enable_sp):
    config = two_layer_config()
    set_decoder_sharding_config(config, loss_parallel=loss_parallel, enable_sp=enable_sp)
    model = config.build()
    actual = {fqn: m.config.sharding_config for fqn, m in model.named_modules() if isinstance(m, Module)}
    expected = expected_plan(loss_parallel=loss_parallel, enable_sp=enable_sp)
    assert sorted(actual) == sorted(expected)
    for fqn, sharding in expected.items():
        assert actual[fqn] == sharding, fqn
    # every parameter is covered by its own module's state_shardings
    for name, _ in model.named_parameters():
        owner, _, param = name.rpartition(".")
        assert param in actual[owner].state_shardings, name


def test_the_two_settings_really_differ(two_layer_config):
    a, b = two_layer_config(), two_layer_config()
    set_decoder_sharding_config(a, loss_parallel=True, enable_sp=False)
    set_decoder_sharding_config(b, loss_parallel=False, enable_sp=True)
    assert a.output.sharding_config.out_dst == tp(Shard(-1)) and b.output.sharding_config.out_dst == R
    assert a.layers[0].attention.o_proj.sharding_config.out_dst == R
    assert b.layers[0].attention.o_proj.sharding_config.out_dst == tp(Shard(1))


def test_placement_helpers():
    assert dense_param_placement(tp=Shard(0)) == {TP: Shard(0)}
    assert dense_activation_placement(tp=Replicate()) == {TP: Replicate(), CP: Shard(1)}
    assert dense_activation_placement(tp=Shard(1), cp=None) == {TP: Shard(1)}


def test_linear_and_norm_helpers():
    assert colwise_config() == ShardingConfig(
        state_shardings={"weight": tp(Shard(0)), "bias": tp(Shard(0))},
        in_src=R, in_dst=R, out_src=tp(Shard(-1)), out_dst=tp(Shard(-1)))
    for output_sp, out in ((True, tp(Shard(1))), (False, R)):
        assert rowwise_config(output_sp=output_sp) == ShardingConfig(
            state_shardings={"weight": tp(Shard(1)), "bias": R},
            in_src=tp(Shard(-1)), in_dst=tp(Shard(-1)), out_src=P, out_dst=out)
    assert norm_config(enable_sp=True) == replicated_weight(tp(Shard(1)))
    assert norm_config(enable_sp=False) == replicated_weight(R)


def test_sub_tree_helpers_keep_bias_entries_only_for_biased_linears(two_layer_config):
    attn = GQAttention.Config(dim=32, n_heads=4, n_kv_heads=2, bias=True)
    set_qkv_linear_sharding(attn)
    assert attn.q_proj.sharding_config == colwise_config() and attn.o_proj.sharding_config is None
    set_gqa_attention_sharding(attn, enable_sp=True)
    assert attn.o_proj.sharding_config == rowwise_config(output_sp=True)
    assert attn.q_norm is None  # no qk_norm: nothing to shard there

    moe = SharedExpertMoE.Config(dim=32, hidden_dim=16, num_experts=4, top_k=2, shared_hidden_dim=24)
    config = two_layer_config()
    config.layers[1].moe = moe
    set_decoder_sharding_config(config, loss_parallel=False, enable_sp=False)
    assert moe.shared_expert.sharding_config == ShardingConfig(in_src=R, in_dst=R)
    assert moe.shared_expert.w2.sharding_config == rowwise(R)
    assert moe.shared_expert_gate.sharding_config == replicated_weight(R)

    ffn = config.layers[0].feed_forward
    set_dense_ffn_sharding(ffn, attn_x_placement=tp(Shard(1)), enable_sp=True)
    assert ffn.sharding_config == ShardingConfig(in_src=tp(Shard(1)), in_dst=R)
    assert ffn.w2.sharding_config == rowwise(tp(Shard(1)))
    assert isinstance(ffn.w1._param_init, Function.Config)  # helpers touch sharding only


def test_split_sequence_over_cp_names_the_token_dim_of_every_activation(two_layer_config):
    """Tokens split over cp at the embedding's input, logits gathered at the output's;
    in between every activation names cp on its token dim (1 of [b, s, ...], 2 of the
    per-head [b, heads, s, d], 0 of the MoE's flattened tokens), so replicated weights'
    gradients are summed over cp; the attention and MoE blocks run on local tensors."""
    config = two_layer_config()
    set_decoder_sharding_config(config, loss_parallel=True, enable_sp=True, split_sequence_over_cp=True)
    model = config.build()
    actual = {fqn: m.config.sharding_config for fqn, m in model.named_modules() if isinstance(m, Module)}

    def act(placement, dim=1):
        return {TP: placement, CP: Shard(dim)}

    x, whole_r = act(Shard(1)), {TP: Replicate(), CP: Replicate()}
    r, flat_r = act(Replicate()), act(Replicate(), 0)
    assert actual["tok_embeddings"] == ShardingConfig(state_shardings={"weight": tp(Shard(0))}, in_src=whole_r,
                                                      in_dst=r, out_src=act(Partial()), out_dst=x)
    assert actual["output"] == ShardingConfig(state_shardings={"weight": tp(Shard(0))}, in_src=x, in_dst=r,
                                              out_src=act(Shard(-1)), out_dst={TP: Shard(-1), CP: Replicate()})
    heads = act(Shard(1), 2)
    assert actual["layers.0.attention"] == ShardingConfig(in_src=(x, None, None), in_dst=(r, None, None),
                                                          local_map=True)
    assert actual["layers.0.attention.q_norm"] == replicated_weight(act(Shard(2)))
    assert actual["layers.0.attention.inner_attention"] == ShardingConfig(
        in_src=(heads, heads, heads, None, None), in_dst=(heads, heads, heads, None, None),
        out_src=act(Shard(2)), out_dst=act(Shard(2)), local_map=True)
    assert actual["layers.0.attention.o_proj"] == ShardingConfig(
        state_shardings={"weight": tp(Shard(1))}, in_src=act(Shard(-1)), in_dst=act(Shard(-1)),
        out_src=act(Partial()), out_dst=x)
    assert actual["layers.1.moe"] == ShardingConfig(in_src=x, in_dst=r, out_src=r, out_dst=x, local_map=True)
    assert actual["layers.1.moe.router"].out_src == (flat_r,) * 3
    assert actual["layers.1.moe.experts"].out_src == act(Partial(), 0)
    for fqn, sharding in actual.items():
        for named in (sharding.in_src, sharding.in_dst, sharding.out_src, sharding.out_dst) if sharding else ():
            for placement in named if isinstance(named, tuple) else (named,):
                assert placement is None or CP in placement, f"{fqn}: {placement} does not name cp"


def test_expert_parallel_splits_the_experts_over_ep(two_layer_config):
    """Both expert weights split on dim 0 over ep (besides their tp split); the tokens
    arrive as each rank's own (Shard(0) on ep), the applier's dispatch routes them."""
    config = two_layer_config()
    set_decoder_sharding_config(config, loss_parallel=False, enable_sp=False, expert_parallel=True)
    EP = MeshAxisName.EP
    arrive = {TP: Replicate(), EP: Shard(0)}
    assert config.layers[1].moe.experts.sharding_config == ShardingConfig(
        state_shardings={"gate_up_proj": {TP: _StridedShard(1, split_factor=2), EP: Shard(0)},
                         "down_proj": {TP: Shard(2), EP: Shard(0)}},
        in_src=(arrive,) * 3, in_dst=(arrive,) * 3, out_src={TP: Partial(), EP: Shard(0)}, out_dst=arrive,
        local_map=True)
    assert config.layers[1].moe.router.sharding_config.state_shardings == {"weight": R}  # the router stays whole
