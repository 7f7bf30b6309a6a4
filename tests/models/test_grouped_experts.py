"""GroupedExperts against transformers' eager Qwen3MoeExperts: same outputs and
gradients (fp32), experts without tokens included; the replacement factory."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoePreTrainedModel

from hyper_parallel.components.modules import routed_experts
from hyper_parallel.components.modules.grouped_experts import GroupedExperts, grouped_experts_class_for
from hyper_parallel.components.modules.routed_experts import ExpertRoutes, ExpertRows
from hyper_parallel.planning.roles import is_packed_experts
from hyper_parallel.models.qwen3_moe.adapter.replacements import (
    GroupedQwen3MoeExperts,
    replace_qwen3_moe_grouped_experts,
)
from tests.models.model_helpers import TINY_MODEL_DIR

# fp32 rounding: the gate/up gradients weight the gradient of act, not the output's (see
# routed_experts); the output and the down-projection gradients are HF's bits.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
TOKENS = 40


@pytest.fixture
def config():
    config = AutoConfig.from_pretrained(TINY_MODEL_DIR)
    config.num_experts = 8  # room for experts that receive no tokens
    config._experts_implementation = "eager"  # HF's per-expert loop, the reference
    return config


def hf_experts(config, seed: int = 0) -> Qwen3MoeExperts:
    torch.manual_seed(seed)
    experts = Qwen3MoeExperts(config)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(experts.down_proj, std=0.1)
    return experts


def routing(config, *, hot_experts: int, seed: int = 1):
    """Tokens, top-k expert ids among the first ``hot_experts`` (the rest get nothing) and
    normalized routing weights, as Qwen3MoeTopKRouter produces them."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, config.hidden_size, generator=gen)
    scores = torch.randn(TOKENS, hot_experts, generator=gen).softmax(-1)
    weights, index = scores.topk(config.num_experts_per_tok, dim=-1)
    return hidden, index, weights / weights.sum(-1, keepdim=True)


def run_with_grads(module, hidden, index, weights, grad_out):
    hidden = hidden.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(hidden, index, weights)
    out.backward(grad_out)
    return out, hidden.grad, weights.grad, module.gate_up_proj.grad, module.down_proj.grad


RESULTS = ("output", "d_hidden", "d_weights", "d_gate_up", "d_down")


def assert_same_results(reference, grouped, hidden, index, weights, grad_out, **tolerance):
    """Output and the four gradients of both modules agree; returns (expected, actual)."""
    expected = run_with_grads(reference, hidden, index, weights, grad_out)
    actual = run_with_grads(grouped, hidden, index, weights, grad_out)
    for name, want, got in zip(RESULTS, expected, actual):
        torch.testing.assert_close(got, want, **(tolerance or TOLERANCE), msg=lambda m, name=name: f"{name}: {m}")
    return expected, actual


@pytest.mark.parametrize("layout", ["packed", "padded", "grouped_mm"])
def test_matches_hf_experts_forward_and_backward(config, layout):
    reference = hf_experts(config)
    grouped = replace_qwen3_moe_grouped_experts(reference, layout=layout)
    hidden, index, weights = routing(config, hot_experts=5)  # experts 5, 6, 7 get no token
    assert set(index.unique().tolist()) <= {0, 1, 2, 3, 4}
    grad_out = torch.randn(TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(2))

    expected, actual = assert_same_results(reference, grouped, hidden, index, weights, grad_out)
    if layout == "packed":  # HF's rows in HF's order through HF's arithmetic: the same bits
        for index, name in ((0, "output"), (4, "d_down")):
            assert torch.equal(actual[index], expected[index]), name
    # Experts without tokens: zero gradient, as HF's.
    assert torch.count_nonzero(actual[3][5:]) == 0 and torch.count_nonzero(actual[4][5:]) == 0
    assert torch.count_nonzero(actual[3][:5]) > 0


@pytest.mark.parametrize("layout", ["packed", "padded", "grouped_mm"])
def test_skewed_routing_matches(config, layout):
    """All tokens on one expert (padding 8x the rows in the padded layout)."""
    reference = hf_experts(config)
    grouped = replace_qwen3_moe_grouped_experts(reference, layout=layout)
    hidden, _, weights = routing(config, hot_experts=5)
    index = torch.stack([torch.full((TOKENS,), 3), torch.arange(TOKENS) % 2], dim=-1)  # expert 3 + experts 0/1
    grad_out = torch.randn(TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(3))
    assert_same_results(reference, grouped, hidden, index, weights, grad_out)


def test_auto_layout_packs_on_cpu_and_pads_elsewhere_while_padding_is_bounded(config):
    grouped = replace_qwen3_moe_grouped_experts(hf_experts(config))
    even = ExpertRoutes.of(torch.arange(16).reshape(8, 2) % 8, config.num_experts)  # 2 rows per expert
    skewed = ExpertRoutes.of(torch.stack([torch.full((8,), 3), torch.arange(8) % 2], -1), config.num_experts)
    assert not grouped._pads(even, torch.device("cpu"))
    assert grouped._pads(even, torch.device("cuda"))
    assert not grouped._pads(skewed, torch.device("cuda"))  # 8 experts x 8 rows for 16 routed rows
    with pytest.raises(ValueError, match="layout 'dense'"):
        replace_qwen3_moe_grouped_experts(hf_experts(config), layout="dense")


def test_auto_layout_takes_torchs_grouped_kernel_on_cuda_in_bfloat16_only(config):
    grouped = replace_qwen3_moe_grouped_experts(hf_experts(config))
    assert not grouped._groups_in_one_kernel(torch.device("cuda"))  # float32: the padded bmm's
    assert not grouped._groups_in_one_kernel(torch.device("cpu"))
    grouped.to(torch.bfloat16)
    assert grouped._groups_in_one_kernel(torch.device("cuda"))
    assert not grouped._groups_in_one_kernel(torch.device("cpu"))
    forced = replace_qwen3_moe_grouped_experts(hf_experts(config), layout="grouped_mm")
    assert forced._groups_in_one_kernel(torch.device("cpu"))


def test_sentinel_expert_ids_select_nothing(config):
    """Id == num_experts (HF's expert-parallel sentinel) contributes nothing, as in HF."""
    reference = hf_experts(config)
    hidden, index, weights = routing(config, hot_experts=5)
    index[::3, 1] = config.num_experts
    grad_out = torch.randn(TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(4))
    for layout in ("packed", "padded", "grouped_mm"):
        grouped = replace_qwen3_moe_grouped_experts(reference, layout=layout)
        assert_same_results(reference, grouped, hidden, index, weights, grad_out)


@pytest.mark.parametrize("layout", ["packed", "padded", "grouped_mm"])
def test_no_routed_tokens_gives_zeros_and_zero_gradients(config, layout):
    """An expert-parallel rank may receive no tokens: its output is zero and its weights
    get zero gradients, not none (data-parallel reductions expect one on every rank)."""
    grouped = replace_qwen3_moe_grouped_experts(hf_experts(config), layout=layout)
    hidden, _, weights = routing(config, hot_experts=5)
    index = torch.full((TOKENS, config.num_experts_per_tok), config.num_experts)
    out, d_hidden, d_weights, d_gate_up, d_down = run_with_grads(grouped, hidden, index, weights,
                                                                  torch.ones(TOKENS, config.hidden_size))
    assert torch.equal(out, torch.zeros_like(hidden))
    for grad in (d_hidden, d_weights, d_gate_up, d_down):
        assert grad is not None and torch.count_nonzero(grad) == 0


def test_factory_copies_weights_and_keeps_the_hf_identity(config):
    reference = hf_experts(config)
    grouped = replace_qwen3_moe_grouped_experts(reference)
    assert type(grouped) is GroupedQwen3MoeExperts and isinstance(grouped, Qwen3MoeExperts)
    assert dict(grouped.named_parameters()).keys() == {"gate_up_proj", "down_proj"}
    assert torch.equal(grouped.gate_up_proj, reference.gate_up_proj)
    assert torch.equal(grouped.down_proj, reference.down_proj)
    assert grouped.gate_up_proj.data_ptr() != reference.gate_up_proj.data_ptr()  # a copy, not a view
    assert is_packed_experts(grouped) and grouped.is_transposed is False  # the planner's packed_experts role


def test_factory_on_meta_stays_on_meta_and_rejects_bad_input(config):
    with torch.device("meta"):
        reference = Qwen3MoeExperts(config)
    grouped = replace_qwen3_moe_grouped_experts(reference)
    assert grouped.gate_up_proj.is_meta and grouped.gate_up_proj.shape == reference.gate_up_proj.shape
    with pytest.raises(TypeError, match="unknown static argument"):
        replace_qwen3_moe_grouped_experts(reference, capacity=2)
    with pytest.raises(TypeError, match="expected packed experts"):
        replace_qwen3_moe_grouped_experts(torch.nn.Linear(4, 4))


def test_tensor_parallel_local_shards_sum_to_the_full_result(config):
    """Sizes come from the tensors: on each tp rank's local shards (gate_up [E, 2I/tp, H]
    with the gate and up halves of the local slice packed, down [E, H, I/tp]) the module
    computes a partial sum; the partial sums add up to the unsharded result."""
    tp = 2
    reference = hf_experts(config)
    full = replace_qwen3_moe_grouped_experts(reference)
    hidden, index, weights = routing(config, hot_experts=6)
    gate, up = reference.gate_up_proj.detach().chunk(2, dim=1)
    partial_sums = []
    for rank in range(tp):
        local = hf_experts(config)
        local.gate_up_proj = torch.nn.Parameter(torch.cat([gate.chunk(tp, 1)[rank], up.chunk(tp, 1)[rank]], 1))
        local.down_proj = torch.nn.Parameter(reference.down_proj.detach().chunk(tp, dim=2)[rank].contiguous())
        shard = replace_qwen3_moe_grouped_experts(local)
        assert shard.intermediate_dim == config.moe_intermediate_size // tp
        partial_sums.append(shard(hidden, index, weights))
    torch.testing.assert_close(sum(partial_sums), full(hidden, index, weights), rtol=1e-5, atol=1e-6)


def test_reset_parameters_after_meta_materialization_matches_hf_init(config):
    """meta → to_empty → reset_parameters draws what HF's _init_weights draws for experts."""
    with torch.device("meta"):
        grouped = GroupedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                 initializer_range=config.initializer_range)
    grouped.to_empty(device="cpu")
    torch.manual_seed(5)
    grouped.reset_parameters()

    hf = Qwen3MoeExperts(config)
    torch.manual_seed(5)
    hf_model(config)._init_weights(hf)
    assert torch.equal(grouped.gate_up_proj, hf.gate_up_proj) and torch.equal(grouped.down_proj, hf.down_proj)
    assert abs(grouped.gate_up_proj.std().item() - config.initializer_range) < 0.002


def test_hf_init_weights_initializes_the_replacement(config):
    """HF's _init_weights dispatches on isinstance(module, Qwen3MoeExperts): the
    replacement is one, so it gets HF's init (and draws no random numbers when built)."""
    state = torch.random.get_rng_state()
    grouped = GroupedQwen3MoeExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
    assert torch.equal(torch.random.get_rng_state(), state)
    with torch.no_grad():
        grouped.gate_up_proj.fill_(7.0)
    hf_model(config)._init_weights(grouped)
    assert grouped.gate_up_proj.abs().max() < 0.2


def hf_model(config) -> Qwen3MoePreTrainedModel:
    """A (meta, weightless) HF model: the owner of the ``_init_weights`` under test."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_replacement_class_is_a_subclass_of_the_replaced_class():
    """A generated file has its own copy of Qwen3MoeExperts; the replacement is one of those."""

    class CopiedExperts(Qwen3MoeExperts):
        pass

    grouped_class = grouped_experts_class_for(CopiedExperts)
    assert issubclass(grouped_class, CopiedExperts) and issubclass(grouped_class, GroupedExperts)
    assert grouped_experts_class_for(CopiedExperts) is grouped_class  # one class per original
    assert grouped_class.forward is GroupedExperts.forward


@pytest.mark.parametrize("block_bytes", [1, 6000], ids=["one-expert-per-block", "few-experts-per-block"])
def test_blocks_of_experts_match(config, monkeypatch, block_bytes):
    """Rows walked a block of whole experts at a time (one expert per block when a single
    row exceeds the budget) give the same outputs and gradients."""
    monkeypatch.setattr(routed_experts, "BLOCK_BYTES", block_bytes)
    reference = hf_experts(config)
    grouped = replace_qwen3_moe_grouped_experts(reference, layout="packed")
    hidden, index, weights = routing(config, hot_experts=6)
    routes = ExpertRoutes.of(index, config.num_experts)
    row_bytes = 4 * (3 * config.hidden_size + 4 * config.moe_intermediate_size)
    blocks = ExpertRows.packed(routes).blocks(row_bytes)
    assert len(blocks) > 1 and sum(block.count for block in blocks) == routes.count
    assert [size for block in blocks for size in block.sizes] == routes.counts_list
    grad_out = torch.randn(TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(5))
    assert_same_results(reference, grouped, hidden, index, weights, grad_out)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_without_grad_and_with_frozen_routing_weights(config, layout):
    """No autograd (nothing kept for backward) and routing weights that need no gradient
    (the unweighted output not kept) still match, and the parameters' gradients too."""
    reference = hf_experts(config)
    grouped = replace_qwen3_moe_grouped_experts(reference, layout=layout)
    hidden, index, weights = routing(config, hot_experts=6)
    with torch.no_grad():
        torch.testing.assert_close(grouped(hidden, index, weights), reference(hidden, index, weights), **TOLERANCE)
    for module in (reference, grouped):
        module.zero_grad(set_to_none=True)
        module(hidden, index, weights).square().sum().backward()
    torch.testing.assert_close(grouped.gate_up_proj.grad, reference.gate_up_proj.grad, **TOLERANCE)
    torch.testing.assert_close(grouped.down_proj.grad, reference.down_proj.grad, **TOLERANCE)


def test_other_activations_take_their_derivative_from_autograd(config):
    config.hidden_act = "gelu"
    reference = hf_experts(config)
    grouped = replace_qwen3_moe_grouped_experts(reference)
    hidden, index, weights = routing(config, hot_experts=6)
    grad_out = torch.randn(TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(6))
    assert_same_results(reference, grouped, hidden, index, weights, grad_out)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bfloat16_is_as_accurate_as_hf_in_bfloat16(config, seed):
    """In bf16 both round differently; each result is as close to the fp32 result as HF's
    own bf16 result is (norm-wise relative error, with room for rounding luck)."""
    hidden, index, weights = routing(config, hot_experts=6, seed=seed + 1)
    grad_out = torch.randn(TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(7 + seed))
    exact = run_with_grads(hf_experts(config, seed), hidden, index, weights, grad_out)
    reference = hf_experts(config, seed).to(torch.bfloat16)
    grouped = replace_qwen3_moe_grouped_experts(reference)
    low = (hidden.to(torch.bfloat16), index, weights.to(torch.bfloat16), grad_out.to(torch.bfloat16))
    hf_bf16, ours = run_with_grads(reference, *low), run_with_grads(grouped, *low)
    assert all(got.dtype == torch.bfloat16 for got in ours)
    for name, want, hf_result, got in zip(RESULTS, exact, hf_bf16, ours):
        hf_error = (hf_result.float() - want).norm() / want.norm()
        error = (got.float() - want).norm() / want.norm()
        assert hf_error < 2e-2 and error <= 1.5 * hf_error, (name, error.item(), hf_error.item())


def test_backward_keeps_no_expert_output(config):
    """What forward saves for backward: per routed row only the gate/up projection and
    act(gate) (widths 2I and I) besides its routing weight, no hidden-size expert output,
    even with the routing weights' gradient needed."""
    grouped = replace_qwen3_moe_grouped_experts(hf_experts(config), layout="packed")
    hidden, index, weights = routing(config, hot_experts=6)
    out = grouped(hidden.requires_grad_(), index, weights.requires_grad_())
    routed = index.numel()
    row_widths = sorted(saved.shape[1] for saved in out.grad_fn.saved_tensors
                        if saved.dim() == 2 and saved.shape[0] == routed)
    assert row_widths == [1, config.moe_intermediate_size, 2 * config.moe_intermediate_size]
