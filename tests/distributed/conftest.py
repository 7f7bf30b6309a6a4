"""Fixtures for the distributed unit tests: the tiny qwen3_moe config and models."""

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers

CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipes/tiny_cpu/models/tiny-qwen3-moe"


@pytest.fixture
def tiny_config():
    return transformers.AutoConfig.from_pretrained(CONFIG_DIR)


def build_meta_model(config):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


@pytest.fixture
def meta_model(tiny_config):
    return build_meta_model(tiny_config)


@pytest.fixture(scope="module")
def world_one_group():
    """A real single-rank gloo process group (DeviceMesh needs one), torn down after the module."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    saved = {key: os.environ.get(key) for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
