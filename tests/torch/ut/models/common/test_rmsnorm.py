import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm as HFQwen3_5RMSNorm
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from hyper_parallel.models.common import Qwen3_5RMSNorm, RMSNorm


def test_rmsnorm_matches_hf_qwen3_moe_rmsnorm(dtype):
    torch.manual_seed(42)
    ref = Qwen3MoeRMSNorm(256, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(256))
    new = RMSNorm.Config(hidden=256, eps=1e-6).build()
    new.weight.data.copy_(ref.weight.data)
    ref, new = ref.to(dtype), new.to(dtype)
    x = torch.randn(2, 8, 256, dtype=dtype)
    assert torch.equal(new(x), ref(x))


def test_qwen3_5_rmsnorm_matches_hf_residual_form(dtype):
    torch.manual_seed(42)
    ref = HFQwen3_5RMSNorm(256, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(256) * 0.1)
    new = Qwen3_5RMSNorm.Config(hidden=256, eps=1e-6).build()
    assert torch.equal(new.weight, torch.zeros(256))  # (1 + w) form starts at w = 0
    new.weight.data.copy_(ref.weight.data)
    ref, new = ref.to(dtype), new.to(dtype)
    x = torch.randn(2, 8, 256, dtype=dtype)
    assert torch.equal(new(x), ref(x))
    assert not torch.equal(new(x), RMSNorm.forward(new, x))  # the two formulas really differ


def test_init_states_resets_each_norm_to_its_identity_weight():
    norm, residual = RMSNorm.Config(hidden=8).build(), Qwen3_5RMSNorm.Config(hidden=8).build()
    for module in (norm, residual):
        module.weight.data.normal_()
        module.init_states()
    assert torch.equal(norm.weight, torch.ones(8)) and torch.equal(residual.weight, torch.zeros(8))
    assert type(Qwen3_5RMSNorm.Config(hidden=8).build()) is Qwen3_5RMSNorm
