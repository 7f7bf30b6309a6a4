"""The custom-backend Qwen3-MoE under torchrun tp2 on CPU (gloo): loss and gradients
equal the single-process HF model's (rtol 1e-5 / 1e-4), with and without sequence
parallel and loss parallel."""

import os
from pathlib import Path

import pytest

from tests.launch import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

REPO_ROOT = Path(__file__).resolve().parents[5]
WORKER = Path(__file__).with_name("tp_custom_backend_worker.py")



def test_tp2_loss_and_grads_match_hf_single_process():
    variants = "sp=0:lp=0,sp=1:lp=1,sp=1:lp=0,sp=0:lp=1"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    result = torchrun([str(WORKER), variants], cwd=REPO_ROOT, env=env, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    for rank in (0, 1):
        assert f"[rank {rank}] OK {variants}" in output, output[-6000:]
