"""Shared fixtures: the tiny Qwen3-MoE config (recipes/tiny_cpu) with HF's eager
attention and eager experts, the reference paths these components mirror op for op."""

from pathlib import Path

import pytest
from transformers import AutoConfig

TINY_QWEN3_MOE = Path(__file__).resolve().parents[5] / "recipes/tiny_cpu/models/tiny-qwen3-moe"


@pytest.fixture
def qwen3_moe_config():
    config = AutoConfig.from_pretrained(TINY_QWEN3_MOE)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


@pytest.fixture(params=["float32", "bfloat16"])
def dtype(request):
    import torch

    return getattr(torch, request.param)
