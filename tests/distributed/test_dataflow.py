"""Roles from dataflow (hyper_parallel/planning/dataflow.py): traced on tiny real models
whose module names say nothing (the remote-code fixtures) and on transformers families
whose structure needs more than names (a norm over a whole projection, global head counts
in a reshape, a fused q/k/v of unequal parts, routers, learned positions)."""

import re
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BloomConfig,
    GPT2Config,
    LlamaConfig,
    Olmo2Config,
    Qwen3Config,
)
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from hyper_parallel.config.context_parallel import ContextParallel
from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.mesh import ParallelDims
from hyper_parallel.planning.dataflow import analyze
from hyper_parallel.planning.linear_blocks import GATHERED_MODE, SPLIT_MODE
from hyper_parallel.planning.local_widths_dry_run import local_widths_dry_run
from hyper_parallel.planning.plan_lint import PlanError
from hyper_parallel.planning.planner import ShardingPlanner
from hyper_parallel.planning.stand_ins import pattern

pytestmark = pytest.mark.slow

REMOTE = Path(__file__).resolve().parents[1] / "data" / "remote_code"
TP = 2


def _tiny(config):
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, trust_remote_code=True, dtype=torch.float32)


def _remote(name: str):
    return _tiny(AutoConfig.from_pretrained(REMOTE / name, trust_remote_code=True))


def _flow(model, tp: int = TP, sequence_split: str | None = None):
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    return analyze(model, ids, tp=tp, dry_run=local_widths_dry_run(model, ids, tp), sequence_split=sequence_split)


def _roles(flow) -> dict[str, str]:
    """Roles by module pattern (every layer alike)."""
    return {pattern(name): role for name, role in flow.roles().items()}


def test_meta_reference_names_say_nothing_dataflow_splits_attention_and_mlp():
    roles = _roles(_flow(_remote("meta_reference")))
    for proj in ("wq", "wk", "wv"):
        assert roles[f"layers.*.attention.{proj}"] == "colwise"
    assert roles["layers.*.attention.wo"] == "rowwise"
    assert roles["layers.*.feed_forward.w1"] == roles["layers.*.feed_forward.w3"] == "colwise"
    assert roles["layers.*.feed_forward.w2"] == "rowwise"


def test_fused_qkv_of_unequal_parts_is_gathered_with_the_reason():
    flow = _flow(_remote("fused_gqa"))
    attention = flow.block_of("decoder.blocks.0.attention.query_key_value")
    # [q | k | v] of unequal widths: only a parent run on its heads could split them, and
    # this attention cannot be built for one rank's share (its widths come from no head count)
    assert attention.mode == GATHERED_MODE and "packs output blocks of unequal widths [64, 32, 32]" in attention.why
    assert "does not have one rank's parameter shapes" in attention.why
    assert attention.roles()["decoder.blocks.0.attention.dense"] == "rowwise_split_input"
    mlp = flow.block_of("decoder.blocks.0.mlp.dense_h_to_4h")
    assert mlp.mode == SPLIT_MODE


def test_list_moe_routers_positions_and_expert_mlps():
    flow = _flow(_remote("list_moe"))
    assert {pattern(name) for name in flow.routers} == {"backbone.layers.*.moe.router"}
    assert "backbone.pos_embed" in flow.standalone  # added to the stream, replicated
    roles = _roles(flow)
    assert roles["backbone.layers.*.moe.experts.*.fc_in"] == "colwise"
    assert roles["backbone.layers.*.moe.experts.*.fc_out"] == "rowwise"
    assert roles["backbone.layers.*.attn.query"] == "colwise"
    assert roles["backbone.layers.*.attn.out"] == "rowwise"


def test_norm_over_the_whole_projection_makes_attention_gathered():
    config = Olmo2Config(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=128)
    flow = _flow(_tiny(config))
    block = flow.block_of("model.layers.0.self_attn.q_proj")
    assert block.mode == GATHERED_MODE and "more than one tp rank" in block.why
    assert flow.block_of("model.layers.0.mlp.down_proj").mode == SPLIT_MODE


def test_per_head_norms_are_head_norms_in_a_split_block():
    config = Qwen3Config(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_hidden_layers=1, vocab_size=128)
    roles = _roles(_flow(_tiny(config)))
    assert roles["model.layers.*.self_attn.q_norm"] == roles["model.layers.*.self_attn.k_norm"] == "head_norm"
    assert roles["model.layers.*.self_attn.q_proj"] == "colwise"
    assert roles["model.layers.*.self_attn.o_proj"] == "rowwise"


def test_a_reshape_with_the_global_head_count_fails_the_dry_run():
    # Bloom views its fused qkv as [batch, seq, num_heads, 3, head_dim] with the config's
    # head count: the per-head layout would split, but its code cannot run on a share.
    config = BloomConfig(hidden_size=64, n_head=4, n_layer=1, vocab_size=128)
    block = _flow(_tiny(config)).block_of("transformer.h.0.self_attention.query_key_value")
    assert block.mode == GATHERED_MODE and "does not run on one rank's share" in block.why


def test_no_split_at_tp1():
    flow = _flow(_remote("fused_gqa"), tp=1)
    assert all(block.mode == SPLIT_MODE for block in flow.blocks)


@pytest.mark.parametrize("fixture", ["meta_reference", "list_moe"])
def test_planner_uses_dataflow_for_modules_names_do_not_classify(fixture):
    tiny = _remote(fixture)
    flow = _flow(tiny)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny.config, trust_remote_code=True)
    dims = ParallelDims(tp=TP)
    # Names alone classify none of their projections: the parts of the layers holding them
    # are left whole (replicated, exact at any tp) and the plan says so, and a module outside
    # the layers (list_moe's pos_embed) is refused; the dataflow splits them.
    if fixture == "list_moe":
        with pytest.raises(Exception, match="cannot classify module backbone.pos_embed"):
            ShardingPlanner(model, Layout(dims)).plan()
    else:
        without = ShardingPlanner(model, Layout(dims)).plan()
        assert [note.split(" replicated")[0] for note in without.notes] == ["layers.*.attention"], without.notes
        assert all(role == "replicate" for name, role in without.roles.items() if ".attention." in name)
    result = ShardingPlanner(model, Layout(dims), dataflow=flow).plan()
    split = {name for name, role in result.roles.items() if role == "colwise"}
    assert split and "tp" in result.applied_axes


def _planned(config, dims: ParallelDims, **options):
    """The planner's result for ``config`` with the dataflow of its tiny copy."""
    tiny = _tiny(config)
    split = "cp" if dims.cp > 1 else "sp" if options.get("sequence_parallel") else None
    flow = _flow(tiny, tp=dims.tp, sequence_split=split)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny.config)
    return ShardingPlanner(model, Layout(dims, **options), dataflow=flow).plan()


def test_learned_activation_between_split_projections_sums_its_gradient_over_tp():
    # Apertus' XIELU has learned scalars between up_proj (colwise) and down_proj (rowwise):
    # each rank sees its features only, so their gradients are partial sums over tp.
    from transformers import ApertusConfig

    config = ApertusConfig(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                           num_hidden_layers=1, vocab_size=128)
    result = _planned(config, ParallelDims(tp=TP))
    assert result.roles["model.layers.0.mlp.act_fn"] == "head_norm"
    assert result.roles["model.layers.0.mlp.up_proj"] == "colwise"


def test_moe_block_with_its_own_vector_is_a_block_under_cp():
    # AFMoE's MoE block holds expert_bias itself (a frozen vector): under cp it is still the
    # MoE block (tokens split inside, router gradients summed over cp) and keeps the vector.
    from transformers import AfmoeConfig

    config = AfmoeConfig(hidden_size=64, intermediate_size=32, moe_intermediate_size=32, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_hidden_layers=2, num_dense_layers=1,
                         num_experts=4, num_experts_per_tok=2, vocab_size=128)
    result = _planned(config, ParallelDims(cp=2))
    block = "model.layers.1.mlp"
    assert result.roles[block] == "moe_block"
    assert "expert_bias" in result.modules[block].state_shardings
    router = result.modules["model.layers.1.mlp.router.gate"]
    assert router.in_src is not None and "cp" in router.in_src[0]


def test_per_head_vector_of_a_gathered_attention_stays_whole():
    # Beam multiplies the attention output by sigmoid(gate_proj(x) + gate_bias[head]) with
    # gate_bias hinted colwise; the dry run finds the block cannot run on local heads, so it
    # is gathered, every rank keeps every head, and gate_bias must not be split.
    from hyper_parallel.codegen.check.probe import shrink_widths
    from hyper_parallel.testing.tiny_families import tiny_config

    config = shrink_widths(tiny_config("beam"), tp=TP, ep=1, seq_len=8, where="beam")
    result = _planned(config, ParallelDims(tp=TP))
    assert result.roles["model.layers.0.self_attn.q_proj"] == "colwise_gathered"
    gate_bias = result.modules["model.layers.0.self_attn"].state_shardings["gate_bias"]
    assert type(gate_bias["tp"]).__name__ == "Replicate"


@pytest.mark.parametrize("dims, options", [(ParallelDims(cp=2), {}), (ParallelDims(tp=TP), {"sequence_parallel": True})])
def test_a_block_adding_the_residual_itself_gathers_it_and_reduces_before_adding(dims, options):
    # Bloom's attention and MLP take the residual and add it to their own output: the block
    # converts that input too, and reduces its partial sums before the add (else the
    # residual would be counted once per tp rank), handing on a slice of the whole.
    config = BloomConfig(hidden_size=64, n_head=4, n_layer=1, vocab_size=128)
    result = _planned(config, dims, **options)
    for block in ("transformer.h.0.self_attention", "transformer.h.0.mlp"):
        entry = result.modules[block]
        assert [position for position, dst in enumerate(entry.in_dst) if dst is not None] == [0, 1], entry.in_dst
        assert type(entry.out_src[0]["tp"]).__name__ == "Replicate", entry.out_src
    dense = result.modules["transformer.h.0.self_attention.dense"]
    assert type(dense.out_dst[0]["tp"]).__name__ == "Replicate"  # reduced inside the block


def test_list_moe_with_more_experts_than_layers_under_cp():
    # tied_moe: 2 layers, 4 experts in a ModuleList, zeros_like accumulator, expert biases.
    tiny = _remote("tied_moe")
    flow = _flow(tiny)
    assert not {pattern(name) for name in flow.outside_sums} & {"body.layers.*.moe", "body.layers.*.attn"}, \
        flow.outside_sums  # zeros_like(t) is a fresh tensor: the MoE does not add its input back
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny.config, trust_remote_code=True)
    dims = ParallelDims(cp=2)
    result = ShardingPlanner(model, Layout(dims), dataflow=_flow(tiny, tp=1)).plan()
    layers = [name for name, role in result.roles.items() if role == "sequence_split"]
    assert layers == ["body.layers.0"], layers  # the decoder layers, not moe.experts (the longest list)
    assert result.roles["body.layers.0.moe"] == "moe_block"


def test_a_split_that_runs_but_computes_other_values_is_gathered():
    # ALiBi slopes built from the local head count: rank 1's share runs, with rank 0's slopes.
    flow = _flow(_remote("alibi_einsum"))
    attention = next(block for block in flow.blocks if any(name.endswith("attn.c_qkv") for name in block.members))
    assert attention.mode == GATHERED_MODE and "is not that rank's slice" in attention.why, attention.why


def test_a_block_returning_flattened_tokens_is_refused_under_sp_and_planned_under_cp():
    # Llama 4's MoE returns [tokens, hidden]: sequence parallel's reduce-scatter along dim 1
    # would split the hidden dim (the decoder layer's view() hid it: wrong numbers, no error).
    from hyper_parallel.testing.tiny_families import tiny_config

    config = tiny_config("llama4_text")
    with pytest.raises(Exception, match=r"sequence_parallel: model.layers.0.feed_forward \(Llama4TextMoe\) "
                                        r"returns its tokens flattened"):
        _planned(config, ParallelDims(tp=TP), sequence_parallel=True)
    assert _planned(config, ParallelDims(cp=2)).roles["model.layers.0.feed_forward"] == "moe_block"


def test_a_block_taking_the_stream_several_times_converts_each():
    # CTRL calls its attention as attn(normed, normed, normed) (v, k, q): under sp every one of
    # the three must be gathered, not only the first (a size mismatch in the attention).
    from hyper_parallel.testing.tiny_families import tiny_config

    result = _planned(tiny_config("ctrl"), ParallelDims(tp=TP), sequence_parallel=True)
    block = result.modules["transformer.h.0.multi_head_attention"]
    assert result.roles["transformer.h.0.multi_head_attention"] == "attention_block"
    assert len(block.in_dst) == 3 and all(type(dst["tp"]).__name__ == "Replicate" for dst in block.in_dst), block.in_dst
    mlp = result.modules["transformer.h.0.ffn"]
    assert len(mlp.in_dst) == 1  # the stream once


def test_a_block_whose_norm_reads_its_partial_sums_reduces_them_first_under_sp():
    # AXK1's MoE ends in post_mlp_layernorm(experts + shared): a norm of partial sums is not
    # a partial sum of norms, so the experts and the shared down projection all-reduce and
    # the block hands on a slice; Qwen3-MoE's block still hands on its partial sum.
    from hyper_parallel.testing.tiny_families import tiny_config

    axk1 = _planned(tiny_config("axk1"), ParallelDims(tp=TP), sequence_parallel=True)
    block = axk1.modules["model.layers.1.mlp"]
    assert type(block.out_src[0]["tp"]).__name__ == "Replicate", block.out_src
    assert type(axk1.modules["model.layers.1.mlp.experts"].out_dst[0]["tp"]).__name__ == "Replicate"
    qwen = _planned(tiny_config("qwen3_moe"), ParallelDims(tp=TP), sequence_parallel=True)
    assert type(qwen.modules["model.layers.0.mlp"].out_src[0]["tp"]).__name__ == "Partial"


def test_decoder_layer_parameters_of_its_own_read_the_sequence_piece():
    # Doge's decoder layer scales the residual with parameters of its own: under sp the
    # first layer's entry both splits the sequence and keeps them, later layers' entries
    # read the piece (so their gradients are summed over the split axis).
    from hyper_parallel.testing.tiny_families import tiny_config

    result = _planned(tiny_config("doge"), ParallelDims(tp=TP), sequence_parallel=True)
    first, second = result.modules["model.layers.0"], result.modules["model.layers.1"]
    assert result.roles["model.layers.0"] == "sequence_split" and "input_residual" in first.state_shardings
    assert type(first.in_dst[0]["tp"]).__name__ == "Shard"
    assert type(second.in_src[0]["tp"]).__name__ == "Shard" and "input_residual" in second.state_shardings


def test_a_module_of_matrices_off_every_block_is_replicated():
    # DBRX's expert GLU holds w1/v1/w2 that the experts' loop slices per expert: no role by
    # name, joined to no projection: replicated rather than refused.
    from hyper_parallel.testing.tiny_families import tiny_config

    result = _planned(tiny_config("dbrx"), ParallelDims(tp=TP))
    assert result.roles["transformer.blocks.0.ffn.experts.mlp"] == "replicate"


class _TokenShiftLayer(LlamaDecoderLayer):
    """A decoder layer mixing each token with the one before it outside its blocks (an
    RWKV-style token shift): exact on the whole sequence, wrong on a piece of it."""

    def forward(self, hidden_states, *args, **kwargs):
        hidden_states = hidden_states + 0.5 * torch.nn.functional.pad(hidden_states, (0, 0, 1, -1))
        return super().forward(hidden_states, *args, **kwargs)


class _GatedShiftLayer(LlamaDecoderLayer):
    """A token shift behind a gate that starts at zero: invisible in a forward of fresh
    weights, token mixing as soon as training moves the gate."""

    def __init__(self, config, index):
        super().__init__(config, index)
        self.shift_gate = torch.nn.Parameter(torch.zeros(config.hidden_size))

    def forward(self, hidden_states, *args, **kwargs):
        hidden_states = hidden_states + self.shift_gate * torch.nn.functional.pad(hidden_states, (0, 0, 1, -1))
        return super().forward(hidden_states, *args, **kwargs)


def _token_shift_llama(layer_class=None):
    layer_class = layer_class or _TokenShiftLayer
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=128)
    model = _tiny(config)
    for index, layer in enumerate(model.model.layers):
        shifted = layer_class(config, index)
        shifted.load_state_dict(layer.state_dict(), strict=False)
        model.model.layers[index] = shifted
    return model


def test_a_token_shift_behind_a_zero_gate_is_refused_too():
    # The dry run perturbs the copy's weights: a gate at zero hides the shift from a forward
    # of fresh weights, not from training.
    tiny = _token_shift_llama(_GatedShiftLayer)
    assert torch.count_nonzero(tiny.model.layers[0].shift_gate) == 0
    flow = _flow(tiny, tp=1, sequence_split="cp")
    assert "is not per-token" in flow.sequence_split_error, flow.sequence_split_error
    assert torch.count_nonzero(tiny.model.layers[0].shift_gate) == 0  # the copy's weights are restored


@pytest.mark.parametrize("dims, options, key", [(ParallelDims(tp=TP), {"sequence_parallel": True}, "sequence_parallel"),
                                                (ParallelDims(cp=2), {}, "cp_size")])
def test_a_token_shift_outside_the_blocks_is_refused_with_its_place(dims, options, key):
    tiny = _token_shift_llama()
    flow = _flow(tiny, tp=dims.tp, sequence_split="cp" if dims.cp > 1 else "sp")
    assert "the input of model.layers.0.self_attn (call 1) differs" in flow.sequence_split_error
    assert "since the split at model.layers.0's input (the model's own code and model.layers.0.input_layernorm) " \
           "is not per-token" in flow.sequence_split_error, flow.sequence_split_error
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny.config)
    planner = ShardingPlanner(model, Layout(dims, **options), dataflow=flow)
    with pytest.raises(Exception, match=rf"accelerator.{key}: a dry run of the split on a tiny copy of "
                                        r"LlamaForCausalLM failed: on piece 2 of 2"):
        planner.plan()
    assert _flow(tiny, tp=TP).sequence_split_error == ""  # not asked for: not run
    plain = _flow(_tiny(LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, num_hidden_layers=2, vocab_size=128)),
                  sequence_split="cp")
    assert plain.sequence_split_error == "" and not plain.whole_after_layers


@pytest.mark.parametrize("dims, options", [(ParallelDims(tp=TP), {"sequence_parallel": True}), (ParallelDims(cp=2), {})])
def test_a_reshape_to_the_whole_sequence_after_the_layers_gathers_the_stream_there(dims, options):
    # GPT-2 reshapes the final norm's output to [batch, the whole sequence, hidden]: on a
    # piece that raises. The final norm gathers the stream instead (it computes on all of
    # it, its gradients complete), and the head takes its cp piece of the whole.
    config = GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=128, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    result = _planned(config, dims, **options)
    norm, head = result.modules["transformer.ln_f"], result.modules["lm_head"]
    assert norm.local_map and [type(p).__name__ for p in norm.in_dst[0].values()] == ["Replicate"] * len(norm.in_dst[0])
    assert type(norm.in_src[0]["cp" if dims.cp > 1 else "tp"]).__name__ == "Shard"
    assert all(type(p).__name__ == "Replicate" for p in head.in_src[0].values()), head.in_src
    if dims.cp > 1:
        assert type(head.in_dst[0]["cp"]).__name__ == "Shard"  # the head computes on its piece
    tiny = _tiny(config)
    assert _flow(tiny, sequence_split="sp").whole_after_layers
    assert result.roles["transformer.h.0.attn"] == "attention_block"
    # A block whose members hand on no partial sum (Conv1D projections are replicated)
    # computes its output whole: it hands on a slice, not a partial sum counted tp times.
    for block in ("transformer.h.0.attn", "transformer.h.0.mlp"):
        members = [name for name in result.roles if name.startswith(block + ".")]
        if all(result.roles[name] == "replicate" for name in members):
            assert type(result.modules[block].out_src[0]["tp"]).__name__ == "Replicate", block


def test_attention_over_a_key_filled_through_views_is_seen_and_its_sinks_stay_whole():
    # HY-V4 fills a fresh key tensor through views (``key[..., :d].copy_(k_nope)``) and its
    # TP plan writes ``self_attn.sinks: colwise``; the trace must see the attention (the
    # base carries what was written into its views), and as the dataflow gathers that
    # attention (a latent shared by every head), every rank keeps every head's sink.
    from hyper_parallel.testing.tiny_families import tiny_config

    config = tiny_config("hy_v4")
    flow = _flow(_tiny(config))
    assert "model.layers.0.self_attn.kv_b_proj" in flow.attention_inputs, sorted(flow.attention_inputs)
    result = _planned(config, ParallelDims(tp=TP))
    assert result.roles["model.layers.0.self_attn.q_b_proj"] == "colwise_gathered"
    sinks = result.modules["model.layers.0.self_attn"].state_shardings["sinks"]
    assert type(sinks["tp"]).__name__ == "Replicate"


def test_an_input_embedding_running_a_module_of_its_own_is_replicated():
    # Inkling-2's embedding normalizes its lookup inside its own forward: split by vocabulary,
    # the norm would see the lookup's partial sums (reduced only at the module's output).
    from hyper_parallel.testing.tiny_families import tiny_config

    result = _planned(tiny_config("inkling2_loop_text"), ParallelDims(tp=TP))
    assert result.roles["model.embed_tokens"] == "replicate"
    assert result.roles["lm_head"] == "lm_head"  # an untied head is still split
    assert _planned(LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                num_hidden_layers=1, vocab_size=128),
                    ParallelDims(tp=TP)).roles["model.embed_tokens"] == "vocab_embedding"


@pytest.mark.parametrize("dims, options", [(ParallelDims(cp=2), {}), (ParallelDims(tp=TP), {"sequence_parallel": True})])
def test_a_block_handing_on_two_streams_splits_both_whole(dims, options):
    # DBRX's norm_attn_norm returns (residual + attention, its norm): both are the stream, so
    # both are handed on split along the sequence, each whole before the split (a partial
    # sum reaching two outputs would be reduced for one only).
    from hyper_parallel.testing.tiny_families import tiny_config

    result = _planned(tiny_config("dbrx"), dims, **options)
    block = result.modules["transformer.blocks.0.norm_attn_norm"]
    assert len(block.out_dst) == 2 and all(type(out["tp"]).__name__ == "Replicate" for out in block.out_src)
    split = "cp" if dims.cp > 1 else "tp"
    assert all(type(out[split]).__name__ == "Shard" for out in block.out_dst), block.out_dst


def test_all_reduce_on_a_module_of_its_own_parameters_sums_their_partial_output():
    # Inkling's shared experts hold 3-d gate/up/down tensors written colwise/colwise/rowwise
    # and the module itself all_reduce: each tensor split as written, the output a partial
    # sum over tp reduced on the way out. At tp 1 (dp, cp) the style needs no role at all.
    from hyper_parallel.testing.tiny_families import tiny_config

    config = tiny_config("inkling_text")
    result = _planned(config, ParallelDims(tp=TP))
    shared = "model.layers.0.mlp.shared_experts"
    assert result.roles[shared] == "local_params_summed"
    states = {name: type(named["tp"]).__name__ + str(getattr(named["tp"], "dim", ""))
              for name, named in result.modules[shared].state_shardings.items()}
    assert states == {"gate_proj": "Shard1", "up_proj": "Shard1", "down_proj": "Shard2"}, states
    assert type(result.modules[shared].out_src[0]["tp"]).__name__ == "Partial"
    # (hidden_states, gammas): the routing weights scale the split intermediate too, so
    # their gradient is a partial sum that only a declared input's boundary reduces.
    assert [type(named["tp"]).__name__ for named in result.modules[shared].in_src] == ["Replicate"] * 2
    assert shared in _planned(config, ParallelDims(dp=2)).roles  # planned, not refused


def test_a_refused_style_needs_no_role_where_nothing_is_split_over_tp():
    # A style no role here means (MLA's kv_a_proj) is about tp; at tp 1 (cp 2) the module
    # is replicated instead of the layout being refused.
    from tests.distributed.test_planner_styles import _meta_model, _plan

    model = _meta_model("qwen3")
    hints = {"model.layers.*.self_attn.k_proj": "mla_kv_a_proj"}
    with pytest.raises(Exception, match="rope slice"):
        _plan(model, hints=hints)
    assert _plan(model, hints=hints, cp=2, tp=1).roles["model.layers.0.self_attn.k_proj"] == "replicate"


def test_a_parameter_handed_out_as_a_view_is_refused_under_a_sequence_split(monkeypatch):
    # GPT-NeoX-Japanese's attention returns its dense_bias, which the layer adds on its piece
    # of the sequence: the applier gives that gradient partial sums over the split axes. A
    # view of it (or one taken into another module) it cannot follow: refused by name.
    from transformers.models.gpt_neox_japanese import modeling_gpt_neox_japanese as neox_j

    from hyper_parallel.testing.tiny_families import tiny_config

    config = tiny_config("gpt_neox_japanese")
    planned = _planned(config, ParallelDims(cp=2))
    assert planned.roles["gpt_neox_japanese.layers.0.attention"] == "attention_block"
    original = neox_j.GPTNeoXJapaneseAttention.forward

    def forward_handing_out_a_view(self, *args, **kwargs):
        output, weights, bias = original(self, *args, **kwargs)
        return output, weights, None if bias is None else bias.view(bias.shape)

    monkeypatch.setattr(neox_j.GPTNeoXJapaneseAttention, "forward", forward_handing_out_a_view)
    with pytest.raises(Exception, match=r"accelerator.cp_size: gpt_neox_japanese.layers.0.attention "
                                        r"\(GPTNeoXJapaneseAttention\) hands out its parameter dense_bias as a view"):
        _planned(config, ParallelDims(cp=2))


def test_modules_after_the_layers_read_the_split_stream_through_other_modules_too():
    # HY-V4's final norm reads its hyper-connection head, which reads the layers: both run
    # on the sequence piece, so both sum their weight gradients over the split axis.
    from hyper_parallel.testing.tiny_families import tiny_config

    config = tiny_config("hy_v4")
    flow = _flow(_tiny(config))
    assert flow.layer_readers == {"model.hc_head"} and flow.after_layers == {"model.hc_head", "model.norm"}
    result = _planned(config, ParallelDims(tp=TP), sequence_parallel=True)
    for name in ("model.hc_head", "model.norm"):
        assert type(result.modules[name].in_src[0]["tp"]).__name__ == "Shard", name


def test_a_block_holding_other_matrices_is_left_whole_not_split_by_names():
    # Inkling-2's attention runs short convolutions (Conv1d) on k and v: the roles lay out
    # nn.Linear weights only, so the dataflow leaves the block whole; names must not split
    # o_proj.gate_proj alone (colwise by its name, against a replicated attention output).
    from hyper_parallel.testing.tiny_families import tiny_config

    result = _planned(tiny_config("inkling2_loop_text"), ParallelDims(tp=TP))
    attention = {name: role for name, role in result.roles.items() if name.startswith("model.layers.0.self_attn.")}
    assert attention and set(attention.values()) == {"replicate"}, attention
    # Its looped layers' attention joins no block in the trace (standalone projections):
    # the names alone would split gate_proj with no partner there too.
    gates = {name: role for name, role in result.roles.items() if name.endswith("o_proj.gate_proj")}
    assert len(gates) == 8 and set(gates.values()) == {"replicate"}, gates
    assert result.roles["model.layers.0.mlp.experts"] == "packed_experts"  # other blocks still split


def test_a_block_whose_parameters_are_read_outside_their_modules_is_gathered_over_cp():
    # DBRX's experts slice their GLU's matrices in the experts' loop, outside the GLU's
    # forward: those stay plain tensors, whose gradients only whole-sequence work makes whole,
    # so context parallel gathers that block like attention (sequence parallel need not).
    from hyper_parallel.testing.tiny_families import tiny_config

    result = _planned(tiny_config("dbrx"), ParallelDims(cp=2))
    block = result.modules["transformer.blocks.0.ffn"]
    assert result.roles["transformer.blocks.0.ffn"] == "gathered_block"
    assert type(block.in_dst[0]["cp"]).__name__ == "Replicate" and type(block.out_dst[0]["cp"]).__name__ == "Shard"
    assert result.modules["transformer.blocks.0.ffn.experts.mlp"].in_src is None  # plain: no token split


def test_experts_taking_no_routing_are_refused_under_expert_parallel():
    # Llama 4 applies its router before the experts, which take the routed hidden states
    # alone: the token dispatch has no top-k indices to route by (a TypeError in training).
    from hyper_parallel.testing.tiny_families import tiny_config

    with pytest.raises(Exception, match=r"accelerator.ep_size: model.layers.0.feed_forward.experts "
                                        r"\(Llama4TextExperts\) takes \(hidden_states\)"):
        _planned(tiny_config("llama4_text"), ParallelDims(dp=2, ep=2))
    assert _planned(tiny_config("qwen3_moe"), ParallelDims(dp=2, ep=2)).roles


def test_heads_tp_cannot_split_leave_attention_whole_and_split_the_rest():
    # GPT-BigCode's multi-query attention has one kv head: tp 2 cannot split it, so the
    # layers' attention is replicated whole (exact at any tp) while the MLP and the
    # vocabulary stay split; the plan's note says why. Without a dataflow to show which
    # modules are attention, the head count is refused as before.
    from hyper_parallel.testing.tiny_families import tiny_config

    config = tiny_config("gpt_bigcode")
    assert config.num_key_value_heads == 1
    result = _planned(config, ParallelDims(tp=TP))
    assert {result.roles[f"transformer.h.0.attn.{name}"] for name in ("c_attn", "c_proj")} == {"replicate"}
    assert (result.roles["transformer.h.0.mlp.c_fc"], result.roles["transformer.h.0.mlp.c_proj"]) == ("colwise", "rowwise")
    assert [note.split(":")[0] for note in result.notes] == ["transformer.h.*.attn replicated whole over tp"]
    assert "num_key_value_heads=1" in result.notes[0]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(PlanError, match="tp_size=2 does not divide config num_key_value_heads=1"):
        ShardingPlanner(model, Layout(ParallelDims(tp=TP))).plan()


def test_a_projection_the_trace_saw_pick_experts_is_replicated_whatever_its_name():
    # ZAYA's router MLP ends in out_proj ("rowwise" by name, beside fc1's colwise split); the
    # trace sees it pick the experts: a router, replicated (rowwise crashed on the ranks).
    from hyper_parallel.testing.tiny_families import tiny_config

    result = _planned(tiny_config("zaya"), ParallelDims(tp=TP))
    assert result.roles["model.layers.0.mlp.gate.router_mlp.out_proj"] == "replicate"


def test_a_linear_weight_applied_outside_its_forward_is_that_linear_output():
    """LongCat-Flash's router applies its classifier's weight itself (``F.linear(x,
    self.classifier.weight)``): the scores top-k picks from are the classifier's output, so
    the classifier is the router. Read as the input's, they named the stream's last writer,
    attention's o_proj, a router, and its attention lost its block."""
    from hyper_parallel.testing.tiny_families import tiny_config

    flow = _flow(_tiny(tiny_config("longcat_flash")))
    assert {pattern(name) for name in flow.routers} == {"model.layers.*.mlp.router.classifier"}
    roles = _roles(flow)
    assert roles["model.layers.*.self_attn.*.o_proj"] in ("rowwise", "rowwise_split_input"), roles
    assert flow.block_of("model.layers.0.self_attn.0.o_proj") is not None


def _small_gdn(family: str):
    """A gated delta-net family with small linear-attention widths (2 key heads, 4 value
    heads of 8 and 16 dims: key_dim 16, value_dim 64), so the packed blocks are unequal."""
    from hyper_parallel.testing.tiny_families import tiny_config

    config = tiny_config(family)
    config.linear_num_key_heads, config.linear_num_value_heads = 2, 4
    config.linear_key_head_dim, config.linear_value_head_dim = 8, 16
    return config


def test_a_mamba2_mixer_is_split_on_its_heads_and_groups():
    """Mamba2's in_proj packs [z | x | B | C | dt] (B and C per group), its convolution
    [x | B | C]; with groups tp divides, each rank keeps its heads and groups: the per-head
    vectors and the gated norm's per-channel weight follow them, the blocks are named by
    the mixer's sizes (B, C: n_groups*ssm_state_size), and its widths are local while it runs."""
    from hyper_parallel.testing.tiny_families import tiny_config

    config = tiny_config("mamba2")
    assert config.n_groups % TP == 0
    result = _planned(config, ParallelDims(tp=TP))
    mixer = "backbone.layers.0.mixer"
    assert result.roles[mixer] == "head_split"
    entry = result.modules[mixer]
    assert {name for name, p in entry.state_shardings.items() if str(p["tp"]) == "S(0)"} == {
        "A_log", "D", "dt_bias", "norm.weight", "in_proj.weight", "conv1d.weight", "conv1d.bias"}
    assert set(entry.local_sizes) == {"num_heads", "intermediate_size", "n_groups", "conv_dim"}
    groups = "n_groups*ssm_state_size"
    assert entry.local_slices["in_proj.weight"] == (0, ("intermediate_size", "intermediate_size", groups, groups,
                                                        "num_heads"))
    assert entry.local_slices["conv1d.weight"] == (0, ("intermediate_size", groups, groups))
    assert result.roles[f"{mixer}.in_proj"] == "colwise_by_parent"
    assert result.roles[f"{mixer}.out_proj"] == "rowwise"
    assert f"{mixer}.norm" not in result.modules  # its weight is the parent's to place


@pytest.mark.parametrize("family, qkv", [("qwen3_next", "in_proj_qkvz"), ("qwen3_5_text", "in_proj_qkv")])
def test_a_gated_delta_net_is_split_on_its_heads(family, qkv):
    """Qwen3-Next packs its projection per key-head group (a plain colwise split keeps whole
    groups); Qwen3.5 packs [q | k | v] of unequal widths, which only the parent can split.
    Either way the layer runs on this rank's heads: the depthwise convolution's channels
    and the per-head vectors follow them, the module's head counts and widths are local
    while it runs, the output projection is rowwise (not gathered, as the HF TP plan says)."""
    result = _planned(_small_gdn(family), ParallelDims(tp=TP))
    layer = "model.layers.0.linear_attn"
    assert result.roles[layer] == "head_split"
    entry = result.modules[layer]
    assert {name: str(p["tp"]) for name, p in entry.state_shardings.items() if "proj" not in name} == {
        "A_log": "S(0)", "dt_bias": "S(0)", "conv1d.weight": "S(0)"}  # packed order (local_views.PackedRows)
    assert set(entry.local_sizes) == {"num_v_heads", "num_k_heads", "key_dim", "value_dim", "conv_dim"}
    assert entry.local_slices["conv1d.weight"] == (0, ("key_dim", "key_dim", "value_dim"))
    assert f"{layer}.conv1d" not in result.modules  # its weight is the parent's to place
    assert result.roles[f"{layer}.out_proj"] == "rowwise"
    assert result.roles[f"{layer}.norm"] == "head_norm"
    if qkv == "in_proj_qkvz":
        assert result.roles[f"{layer}.{qkv}"] == result.roles[f"{layer}.in_proj_ba"] == "colwise"
    else:
        assert result.roles[f"{layer}.{qkv}"] == "colwise_by_parent"
        assert entry.local_slices[f"{qkv}.weight"] == (0, ("key_dim", "key_dim", "value_dim"))
        assert result.roles[f"{layer}.in_proj_z"] == "colwise"


def test_a_packed_parameter_stays_replicated_over_tp_where_fsdp2_splits_its_rows():
    """Packed order is one tp split of the rows; FSDP2 would split them again over dp, so
    under dp the packed convolution is stored replicated over tp and each rank takes its
    piece as the layer runs (the same local_slices)."""
    result = _planned(_small_gdn("qwen3_next"), ParallelDims(tp=TP, dp=2))
    entry = result.modules["model.layers.0.linear_attn"]
    assert str(entry.state_shardings["conv1d.weight"]["tp"]) == "R"
    assert str(entry.state_shardings["A_log"]["tp"]) == "S(0)"
    assert entry.local_slices["conv1d.weight"] == (0, ("key_dim", "key_dim", "value_dim"))


def test_a_head_split_whose_sizes_tp_does_not_divide_is_refused_naming_them():
    """The traced copy divides (2 key heads at tp 2); the recipe's model at tp 4 does not."""
    config = _small_gdn("qwen3_next")
    tiny = _tiny(config)
    flow = _flow(tiny)
    dims = ParallelDims(tp=4)
    config.num_attention_heads, config.num_key_value_heads = 8, 4
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(PlanError, match=r"num_k_heads = 2 does not divide into 4 equal shares"):
        ShardingPlanner(model, Layout(dims), dataflow=flow).plan()


def test_parameter_layouts_from_what_each_rank_needs():
    from torch.distributed.tensor import Replicate

    from hyper_parallel.planning.linear_blocks import _param_layout, _rank_blocks

    def need(owner, shape_tail=()):
        mask = torch.zeros(2, len(owner), *shape_tail, dtype=torch.bool)
        for index, rank in enumerate(owner):
            if rank >= 0:
                mask[rank, index] = True
        return mask

    assert _param_layout(need([0, 0, 1, 1]), 2) == 0  # a contiguous chunk each: shard(0)
    assert _param_layout(need([0, 1, 0, 1, 0, 0, 1, 1], (3,)), 2) == (0, [2, 2, 4])  # unequal blocks
    assert _param_layout(torch.ones(2, 4, dtype=torch.bool), 2) == Replicate()  # every rank needs all
    assert _param_layout(need([0, 1, 1, 0]), 2) is None  # no layout of whole heads
    assert _rank_blocks([0, 0, 1, 1, 0, 1], 2) == [4, 2]
    assert _rank_blocks([0, 1, 1], 2) == [] and _rank_blocks([0, -1], 2) == []


@pytest.mark.parametrize("tp", [1, 2])
def test_a_block_tied_across_layers_gets_one_entry_for_every_place_it_is_reached(tp):
    """Zamba ties its shared transformer block across its hybrid layers: one tensor reached
    under several names. The traced copy saw it as a block only under the first name; the
    other names planned it replicated, and the plan gave one tensor two placements."""
    from hyper_parallel.testing.tiny_families import tiny_config

    dims = ParallelDims(tp=tp) if tp > 1 else ParallelDims(dp=2)
    result = _planned(tiny_config("zamba"), dims)
    shared = sorted(name for name in result.modules if name.endswith("shared_transf.self_attn.q_proj"))
    assert len(shared) >= 2
    assert len({str(result.modules[name]) for name in shared}) == 1
    assert len({result.roles[name] for name in shared}) == 1


@pytest.mark.parametrize("family", ["qwen3_next", "mamba2"])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_recurrent_layer_under_cp_hands_its_state_on_and_the_plan_says_so(family, tp):
    """Under cp a gated delta-net or a Mamba2 mixer runs on the rank's piece, its state handed
    on from the previous cp rank (role state_handoff, ``state_handoff: cp``); the convolution
    weight its code hands to a kernel is placed by the block's entry (a local tensor there),
    with or without its heads split over tp; derive says so in a note."""
    from hyper_parallel.testing.tiny_families import tiny_config

    config = _small_gdn(family) if family == "qwen3_next" else tiny_config(family)
    result = _planned(config, ParallelDims(cp=2, tp=tp))
    block = next(name for name, role in result.roles.items() if role == "state_handoff")
    entry = result.modules[block]
    assert entry.state_handoff == "cp" and entry.local_map
    assert "conv1d.weight" in entry.state_shardings and f"{block}.conv1d" not in result.modules
    assert bool(entry.local_sizes) == (tp > 1)
    glob = re.sub(r"\.\d+\.", ".*.", block)
    assert any(note.startswith(f"{glob} under cp: each rank runs its piece") for note in result.notes), result.notes


def test_a_recurrent_layer_under_load_balanced_cp_is_gathered_and_the_plan_says_why():
    """Load balancing gives each cp rank two pieces from both ends: no state can go from rank
    to rank, so the block is gathered (exact), and the note names the setting."""
    result = _planned(_small_gdn("qwen3_next"), ParallelDims(cp=2),
                      context_parallel=ContextParallel("allgather_kv", True))
    assert result.roles["model.layers.0.linear_attn"] == "gathered_block"
    assert any(note.startswith("model.layers.*.linear_attn gathered over cp") and "load_balance" in note
               for note in result.notes), result.notes


def test_a_layer_part_with_vectors_of_its_own_no_role_places_is_left_whole():
    """RWKV's feed-forward block: time-mix vectors beside its key/receptance/value
    projections, no role for the block itself: the whole part is replicated (exact at any
    tp), and derive says so, instead of refusing the family."""
    from hyper_parallel.testing.tiny_families import tiny_config

    result = _planned(tiny_config("rwkv"), ParallelDims(tp=TP))
    assert any(note.startswith("rwkv.blocks.*.feed_forward replicated whole over tp") for note in result.notes)
    part = {name: role for name, role in result.roles.items() if name.startswith("rwkv.blocks.0.feed_forward")}
    assert part and set(part.values()) == {"replicate"}, part
