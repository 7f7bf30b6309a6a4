"""Grouped experts on CUDA (issue 52, item 5) against transformers' own ``grouped_mm`` experts
(what a GPU user of transformers runs) and its eager loop, on one GPU. Marked ``gpu``."""

import pytest
import torch

from hyper_parallel.models.qwen3_moe.adapter.replacements import replace_qwen3_moe_grouped_experts
from tests.models.test_grouped_experts import RESULTS, TOKENS, hf_experts, routing, run_with_grads

pytestmark = pytest.mark.gpu


@pytest.fixture
def config():
    from transformers import AutoConfig

    from tests.models.model_helpers import TINY_MODEL_DIR

    config = AutoConfig.from_pretrained(TINY_MODEL_DIR)
    config.num_experts = 8
    return config


def _on_cuda(*tensors):
    return tuple(t.cuda() for t in tensors)


def test_fp32_on_cuda_matches_hf_eager_experts(config):
    config._experts_implementation = "eager"
    hidden, index, weights = _on_cuda(*routing(config, hot_experts=5))
    grad_out = torch.randn(TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(2)).cuda()
    reference = hf_experts(config).cuda()
    expected = run_with_grads(reference, hidden, index, weights, grad_out)
    actual = run_with_grads(replace_qwen3_moe_grouped_experts(reference), hidden, index, weights, grad_out)
    for name, want, got in zip(RESULTS, expected, actual):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_on_cuda_is_as_accurate_as_hf_grouped_mm(config, seed):
    """Each result's error against the fp32 result is at most 1.5x that of transformers'
    grouped_mm experts in bf16 (the kernel transformers runs on a GPU)."""
    config._experts_implementation = "eager"
    hidden, index, weights = _on_cuda(*routing(config, hot_experts=6, seed=seed + 1))
    grad_out = torch.randn(TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(7 + seed)).cuda()
    exact = run_with_grads(hf_experts(config, seed).cuda(), hidden, index, weights, grad_out)
    config._experts_implementation = "grouped_mm"
    reference = hf_experts(config, seed).cuda().to(torch.bfloat16)
    low = (hidden.bfloat16(), index, weights.bfloat16(), grad_out.bfloat16())
    hf_bf16 = run_with_grads(reference, *low)
    ours = run_with_grads(replace_qwen3_moe_grouped_experts(reference), *low)
    for name, want, hf_result, got in zip(RESULTS, exact, hf_bf16, ours):
        hf_error = (hf_result.float() - want).norm() / want.norm()
        error = (got.float() - want).norm() / want.norm()
        assert hf_error < 2e-2 and error <= 1.5 * hf_error, (name, error.item(), hf_error.item())
