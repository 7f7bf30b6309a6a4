import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

from hyper_parallel.models.common import FeedForward

HF_TO_OURS = {"gate_proj.weight": "w1.weight", "up_proj.weight": "w3.weight", "down_proj.weight": "w2.weight"}


def test_swiglu_matches_qwen3_moe_mlp(qwen3_moe_config, dtype):
    torch.manual_seed(0)
    ref = Qwen3MoeMLP(qwen3_moe_config, intermediate_size=128)
    new = FeedForward.Config(dim=qwen3_moe_config.hidden_size, hidden_dim=128).build()
    new.load_state_dict({HF_TO_OURS[k]: v for k, v in ref.state_dict().items()})
    ref, new = ref.to(dtype), new.to(dtype)
    x = torch.randn(2, 8, qwen3_moe_config.hidden_size, dtype=dtype)
    assert torch.equal(new(x), ref(x))


def test_sub_configs_follow_dims_unless_given():
    cfg = FeedForward.Config(dim=16, hidden_dim=40)
    assert (cfg.w1.in_features, cfg.w1.out_features, cfg.w2.in_features, cfg.w2.out_features) == (16, 40, 40, 16)
    assert not cfg.w1.bias
    ffn = cfg.build()
    assert [name for name, _ in ffn.named_parameters()] == ["w1.weight", "w2.weight", "w3.weight"]
