"""Context parallel that splits attention (``accelerator.context_parallel``): allgather_kv
with and without load balance and ulysses, at cp2 and tp2+cp2 (with sequence parallel),
eager and sdpa, GQA, tied embeddings, the fused attention replacement, equals the
single-process HF model (fp32: loss of three AdamW steps rtol 1e-5, every gradient rtol
1e-4 / atol 1e-6), and the attention really computes S/cp queries (allgather_kv) or the
whole sequence of 1/cp of the heads (ulysses)."""

import copy
import math
import re

import pytest
import torch

from hyper_parallel.distributed.context_parallel import SequenceOrder, balanced_order
from tests.batch_launch import Batches
from tests.launch import torchrun
from tests.project_fixtures import REPO

SEQ = 16
# id: (world, worker flags)
CASES = {
    "cp2_sdpa": (2, ["--cp", "2", "--attn", "sdpa"]),
    "cp2_sdpa_balanced": (2, ["--cp", "2", "--attn", "sdpa", "--load-balance"]),
    "cp2_eager_balanced": (2, ["--cp", "2", "--attn", "eager", "--load-balance"]),
    "cp2_eager_tied_balanced": (2, ["--cp", "2", "--attn", "eager", "--load-balance", "--family", "llama"]),
    "tp2_cp2_sdpa_balanced": (4, ["--cp", "2", "--tp", "2", "--attn", "sdpa", "--load-balance"]),
    "tp2_cp2_eager": (4, ["--cp", "2", "--tp", "2", "--attn", "eager"]),
    "tp2_cp2_sp_eager_tied_balanced": (4, ["--cp", "2", "--tp", "2", "--sp", "--attn", "eager", "--load-balance",
                                           "--family", "llama"]),
    "cp2_fused_balanced": (2, ["--cp", "2", "--attn", "sdpa", "--load-balance", "--fused"]),
    "cp2_sdpa_ulysses": (2, ["--cp", "2", "--attn", "sdpa", "--algorithm", "ulysses"]),
    "cp2_eager_ulysses": (2, ["--cp", "2", "--attn", "eager", "--algorithm", "ulysses"]),
    "tp2_cp2_sdpa_ulysses_mha": (4, ["--cp", "2", "--tp", "2", "--attn", "sdpa", "--algorithm", "ulysses",
                                     "--kv-heads", "4", "--family", "llama"]),
    "cp4_sdpa_balanced": (4, ["--cp", "4", "--attn", "sdpa", "--load-balance"]),
    "cp4_eager_ulysses_mha": (4, ["--cp", "4", "--attn", "eager", "--algorithm", "ulysses", "--kv-heads", "4"]),
    "cp2_ep2_moe_eager_balanced": (2, ["--cp", "2", "--ep", "2", "--attn", "eager", "--load-balance",
                                       "--family", "qwen3_moe"]),
    "cp2_ep2_moe_sdpa_ulysses": (2, ["--cp", "2", "--ep", "2", "--attn", "sdpa", "--algorithm", "ulysses",
                                     "--family", "qwen3_moe"]),
}


# the explicit baseline, run in the world-2 batch with the cases above
GATHER_SEQUENCE = "cp2_gather_sequence_balanced"
BATCHED = {**CASES, GATHER_SEQUENCE: (2, ["--cp", "2", "--algorithm", "gather_sequence", "--load-balance"])}


def _launch(world: int, out, cases):
    return torchrun(["-m", "tests.distributed.context_parallel_worker", "--out", str(out), "--cases", str(cases)],
                    cwd=REPO, nproc=world, timeout=600)


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """One torchrun launch per world size runs every layout of that size in turn, in the
    same ranks (tests/batch_launch.py): rank start-up (python, torch, transformers) once
    per launch, not once per layout. Each test reads its own layout's per-rank results,
    so a failure names the layout."""
    cases = {name: (world, ["--seq-len", str(SEQ), *flags]) for name, (world, flags) in BATCHED.items()}
    return Batches(tmp_path_factory.mktemp("context_parallel"), cases, _launch)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
def test_allgather_kv_matches_single_process(case, batches):
    world, flags = CASES[case]
    ulysses = "ulysses" in flags
    algorithm, role = ("ulysses", "ulysses_attention") if ulysses else ("allgather_kv", "kv_gathered_attention")
    balanced = "--load-balance" in flags
    tp = int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1
    cp = int(flags[flags.index("--cp") + 1])
    for result in batches.results(case):
        assert result["context_parallel"] == {"algorithm": algorithm, "load_balance": balanced}
        assert role in result["roles"] and "attention_block" not in result["roles"]
        assert result["grad_failures"] == [], result["grad_failures"]
        assert result["grads_checked"] == result["param_count"] > 0
        ref, par = result["losses"]["reference"], result["losses"]["parallel"]
        assert len(par) == 3 and par[2] < par[0]
        for ours, theirs in zip(par, ref):
            assert math.isclose(ours, theirs, rel_tol=1e-5), (par, ref)
        # the attention work is split: every call saw this rank's S/cp tokens only, and the
        # inner attention computed S/cp queries of every local head (allgather_kv) or the
        # whole sequence of this rank's half of the local heads (ulysses)
        assert result["attention_blocks"] == 2
        assert result["query_lengths"] == [SEQ // cp]
        heads = 4 // tp
        assert result["inner_shapes"] == ([[heads // cp, SEQ]] if ulysses else [[heads, SEQ // cp]])
        assert result["attention_calls"] >= 2 * 3
        # sdpa's causal case on CPU runs by mask-free chunks; eager takes the mask rows
        if flags[flags.index("--attn") + 1] == "sdpa" and not ulysses:
            assert result["mask_free_calls"] == result["attention_calls"]
        else:
            assert result["mask_free_calls"] == 0
        assert result["attn_implementation"].startswith("hyper_cp_")
        assert not result["reference_attn_implementation"].startswith("hyper_cp_")
        assert result["local_logits_shape"] == [2, SEQ // cp, 128]  # logits stay split into the sharded loss


@pytest.mark.slow
@pytest.mark.distributed
def test_gather_sequence_keeps_whole_sequence_attention(batches):
    """The explicit baseline: the block gathers its input, no attention wrapper is installed."""
    for result in batches.results(GATHER_SEQUENCE):
        assert result["context_parallel"] is None  # the layout's default: no cp keys means gather_sequence
        assert "attention_block" in result["roles"]
        assert result["attention_blocks"] == 0
        assert result["grad_failures"] == []
        assert math.isclose(result["losses"]["parallel"][0], result["losses"]["reference"][0], rel_tol=1e-5)


def test_balanced_order_gives_rank_r_chunks_r_and_mirror():
    order = balanced_order(16, 2)  # chunks of 4: rank 0 holds c0, c3; rank 1 holds c1, c2
    assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    sequence = SequenceOrder(2)
    x = torch.arange(16).view(1, 16)
    assert torch.equal(sequence.restore(sequence.permute(x)), x)
    assert sequence.local_positions(16, 1, "cpu").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_balanced_order_refuses_indivisible_length():
    with pytest.raises(ValueError, match=r"sequence length 10 must be divisible by 2\*cp_size = 4.*load_balance"):
        balanced_order(10, 2)


def test_allgather_kv_refuses_attention_outside_the_attention_interface():
    # Bloom's attention takes the residual and ALiBi biases and computes attention in its
    # own code: K/V cannot be gathered there; the error names the key and the fix.
    from transformers import BloomConfig

    from hyper_parallel.config.context_parallel import ContextParallel
    from hyper_parallel.distributed.mesh import ParallelDims
    from hyper_parallel.planning.plan_lint import PlanError
    from tests.distributed.test_dataflow import _planned

    config = BloomConfig(hidden_size=64, n_head=4, n_layer=1, vocab_size=128)
    with pytest.raises(PlanError, match=r"accelerator\.context_parallel\.algorithm: allgather_kv: "
                                        r"transformer\.h\.0\.self_attention \(BloomAttention\).*gather_sequence"):
        _planned(config, ParallelDims(cp=2), context_parallel=ContextParallel("allgather_kv", True))
    # the baseline still plans it (whole-sequence attention on every cp rank)
    result = _planned(config, ParallelDims(cp=2), context_parallel=ContextParallel("gather_sequence", False))
    assert result.roles["transformer.h.0.self_attention"] == "attention_block"
    # left to its default, the recipe gets the block gathered, and a note naming it and why
    result = _planned(config, ParallelDims(cp=2), context_parallel=ContextParallel("allgather_kv", True, True))
    assert result.roles["transformer.h.0.self_attention"] == "attention_block"
    assert result.context_parallel == ContextParallel("allgather_kv", True, by_default=True)
    [note] = [note for note in result.notes if "gathered over cp" in note]
    assert note.startswith("transformer.h.*.self_attention gathered over cp: accelerator.context_parallel.algorithm "
                           "is left to its default (allgather_kv)")
    assert "BloomAttention" in note and "more than one stream" in note


def test_the_default_algorithm_gathers_attention_of_an_implementation_it_does_not_wrap():
    """allgather_kv wraps eager and sdpa: by default a model running another attention
    implementation gathers its attention blocks (named) instead of being refused; named
    in the recipe, it is refused."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from hyper_parallel.config.context_parallel import ContextParallel
    from hyper_parallel.config.layout import Layout
    from hyper_parallel.distributed.mesh import ParallelDims
    from hyper_parallel.planning.plan_lint import PlanError
    from hyper_parallel.planning.planner import ShardingPlanner
    from tests.distributed.test_dataflow import _flow, _tiny

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
    tiny, dims = _tiny(config), ParallelDims(cp=2)
    flow = _flow(tiny, tp=1, sequence_split="cp")

    def planned(implementation: str, context_parallel: ContextParallel):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tiny.config)
        model.config._attn_implementation = implementation
        return ShardingPlanner(model, Layout(dims, context_parallel=context_parallel), dataflow=flow).plan()

    result = planned("flex_attention", ContextParallel("allgather_kv", True, by_default=True))
    assert {result.roles[f"model.layers.{i}.self_attn"] for i in range(2)} == {"attention_block"}
    assert any("model.layers.*.self_attn gathered over cp" in note and "'flex_attention'" in note
               for note in result.notes)
    with pytest.raises(PlanError, match=r"algorithm: allgather_kv: model\.layers\.0\.self_attn \(MistralAttention\) "
                                        r"runs the attention implementation 'flex_attention'"):
        planned("flex_attention", ContextParallel("allgather_kv", True))
    result = planned("sdpa", ContextParallel("allgather_kv", True, by_default=True))
    assert result.roles["model.layers.0.self_attn"] == "kv_gathered_attention"
    assert not any("gathered over cp" in note for note in result.notes)


def test_allgather_kv_plan_keeps_tokens_split_through_attention():
    from transformers import MistralConfig

    from hyper_parallel.config.context_parallel import ContextParallel
    from hyper_parallel.config.layout import Layout
    from hyper_parallel.distributed.mesh import ParallelDims
    from hyper_parallel.planning.planner import ShardingPlanner
    from hyper_parallel.protocols.placements import placement_to_text

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dims = ParallelDims(cp=2, tp=2)
    result = ShardingPlanner(model, Layout(dims, context_parallel=ContextParallel("allgather_kv", True))).plan()
    assert result.context_parallel == ContextParallel("allgather_kv", True)
    block = result.modules["model.layers.1.self_attn"]
    assert result.roles["model.layers.1.self_attn"] == "kv_gathered_attention"
    text = lambda named: {axis: placement_to_text(p) for axis, p in named.items()}  # noqa: E731
    assert text(block.in_dst[0]) == {"cp": "shard(1)", "tp": "replicate"}
    assert text(block.out_src[0]) == {"cp": "shard(1)", "tp": "partial"}
    for member in ("q_proj", "k_proj", "v_proj", "o_proj"):
        entry = result.modules[f"model.layers.1.self_attn.{member}"]
        assert text(entry.in_src[0])["cp"] == "shard(1)", member  # weight gradients summed over cp
    # without cp nothing is recorded
    tp_only = Layout(ParallelDims(tp=2), context_parallel=ContextParallel("allgather_kv", True))
    plain = ShardingPlanner(model, tp_only).plan()
    assert plain.context_parallel is None


def test_context_parallel_in_spec_signature_only_with_cp():
    from hyper_parallel.config.context_parallel import ContextParallel
    from hyper_parallel.config.layout import Layout
    from hyper_parallel.distributed.mesh import ParallelDims

    def spec(cp, algorithm, balance):
        return Layout(dims=ParallelDims(cp=cp), context_parallel=ContextParallel.effective(algorithm, balance, cp))

    assert "cp_algorithm" not in spec(1, "allgather_kv", True).as_dict()
    assert spec(1, "allgather_kv", True).as_dict() == spec(1, "gather_sequence", False).as_dict()
    kv = spec(2, "allgather_kv", True).as_dict()
    assert (kv["cp_algorithm"], kv["cp_load_balance"]) == ("allgather_kv", True)
    assert spec(2, "allgather_kv", False).as_dict() != kv
    # gather_sequence has no load balance: both spellings sign the same, as bundles made
    # before the key existed do
    assert spec(2, "gather_sequence", True).as_dict() == spec(2, "gather_sequence", False).as_dict()
    assert "cp_algorithm" not in spec(2, "gather_sequence", True).as_dict()


@pytest.mark.parametrize("chunks", [(0, 3), (1, 2), (2,), (3,)])
def test_mask_free_chunks_equal_causal_sdpa_with_gqa(chunks):
    # a rank's query chunks against the whole sequence's K/V (2 kv heads for 4 query
    # heads): output and every gradient equal sdpa's is_causal on the whole sequence
    import torch.nn.functional as F

    from hyper_parallel.distributed.causal_blocks import chunked_causal_attention

    generator = torch.Generator().manual_seed(0)
    size, length = 8, 32
    q, k, v = (torch.randn(2, heads, length, 16, generator=generator) for heads in (4, 2, 2))
    grad = torch.randn(2, 4, length, 16, generator=generator)
    rows = torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])
    ours = [t.clone().requires_grad_(True) for t in (q, k, v)]
    theirs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = chunked_causal_attention(ours[0][:, :, rows], ours[1], ours[2], chunks, 16 ** -0.5)
    out.backward(grad[:, :, rows])
    ref = F.scaled_dot_product_attention(theirs[0], theirs[1].repeat_interleave(2, 1),
                                         theirs[2].repeat_interleave(2, 1), is_causal=True)[:, :, rows]
    ref.backward(grad[:, :, rows])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-5, atol=1e-6)


def test_ulysses_refuses_heads_tp_times_cp_does_not_divide():
    from transformers import AutoModelForCausalLM, MistralConfig

    from hyper_parallel.config.context_parallel import ContextParallel
    from hyper_parallel.config.layout import Layout
    from hyper_parallel.distributed.mesh import ParallelDims
    from hyper_parallel.planning.plan_lint import PlanError
    from hyper_parallel.planning.planner import ShardingPlanner

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dims = ParallelDims(cp=2, tp=2)
    with pytest.raises(PlanError, match=r"accelerator\.context_parallel\.algorithm: ulysses splits the heads over "
                                        r"tp\*cp = 2\*2 = 4, which does not divide num_key_value_heads=2; use "
                                        r"algorithm: allgather_kv"):
        ShardingPlanner(model, Layout(dims, context_parallel=ContextParallel("ulysses", False))).plan()


def test_the_dry_run_on_one_rank_s_tokens_finds_attention_code_using_the_whole_sequence():
    """Qwen4-Exp's softmax attention builds a key-selection mask over the tokens it is
    handed and combines it with the whole sequence's mask: the static checks pass it, the
    dry run on each cp rank's tokens (token_attention_dry_run) fails it, naming the error;
    a plain attention (Llama, eager and sdpa) passes."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hyper_parallel.testing.tiny_families import tiny_config
    from hyper_parallel.planning.token_attention_dry_run import token_attention_refusals

    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    config = tiny_config("qwen4_exp_text")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    softmax = [f"model.layers.{index}.self_attn" for index, kind in enumerate(config.layer_types)
               if kind != "linear_attention"]
    refused = token_attention_refusals(model, ids, softmax, {})
    assert set(refused) == set(softmax)
    assert "on its tokens it fails: RuntimeError" in refused[softmax[0]]
    for implementation in ("eager", "sdpa"):
        plain = AutoModelForCausalLM.from_config(LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2), attn_implementation=implementation)
        assert token_attention_refusals(plain, ids, ["model.layers.0.self_attn", "model.layers.1.self_attn"],
                                        {}) == {}, implementation


@pytest.mark.parametrize("family, block, why", [
    # JetMoE's attention calls its experts' ``reduce``, which adds the experts' own bias:
    # a parameter of a container used outside the container's forward
    ("jetmoe", "model.layers.*.self_attention", "outside its forward"),
    # ZAYA's value path delays each value by one token and a convolution mixes q/k over the
    # sequence: on a rank's tokens the first one lacks its predecessor, which only the
    # dry run with K/V gathered from both ranks' own (not the whole sequence's) shows
    ("zaya", "model.layers.*.self_attn", "its code uses the sequence beyond the attention function"),
])
def test_the_default_algorithm_gathers_attention_reading_beyond_its_tokens(family, block, why):
    """Left to the default, an attention block whose code reads beyond the rank's tokens is
    gathered over cp with a note naming it and why; named in the recipe, it is refused."""
    from transformers import AutoModelForCausalLM

    from hyper_parallel.testing.tiny_families import tiny_config
    from hyper_parallel.config.context_parallel import ContextParallel
    from hyper_parallel.planning.stand_ins import pattern
    from hyper_parallel.config.layout import Layout
    from hyper_parallel.distributed.mesh import ParallelDims
    from hyper_parallel.planning.plan_lint import PlanError
    from hyper_parallel.planning.planner import ShardingPlanner
    from tests.distributed.test_dataflow import _flow, _tiny

    tiny, dims = _tiny(copy.deepcopy(tiny_config(family))), ParallelDims(cp=2)
    flow = _flow(tiny, tp=1, sequence_split="cp")  # one trace (and dry run) for both plans

    def planned(context_parallel: ContextParallel):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tiny.config)
        return ShardingPlanner(model, Layout(dims, context_parallel=context_parallel), dataflow=flow).plan()

    result = planned(ContextParallel("allgather_kv", True, by_default=True))
    attention = [name for name in result.roles if pattern(name) == block]
    assert attention and {result.roles[name] for name in attention} == {"attention_block"}
    [note] = [note for note in result.notes if note.startswith(f"{block} gathered over cp")]
    assert why in note
    with pytest.raises(PlanError, match=r"algorithm: allgather_kv: " + re.escape(block.replace("*", "0"))):
        planned(ContextParallel("allgather_kv", True))
