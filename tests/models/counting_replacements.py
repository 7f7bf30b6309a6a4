"""Replacement factories that count their calls (recipes name them by dotted path)."""

from hyper_parallel.models.qwen3_moe.adapter.replacements import replace_qwen3_moe_grouped_experts
from hyper_parallel.models.qwen3_moe.adapter.replacements import replace_qwen3_moe_flash_attention

CALLS = {"attention": 0, "experts": 0}


def counted_attention(module, **kwargs):
    CALLS["attention"] += 1
    return replace_qwen3_moe_flash_attention(module, **kwargs)


def counted_experts(module, **kwargs):
    CALLS["experts"] += 1
    return replace_qwen3_moe_grouped_experts(module, **kwargs)
