"""MoE / Router / Experts / SharedExpertMoE against HF's Qwen3-MoE and Qwen3.5-MoE sparse
blocks on the eager experts path, weights copied, same inputs."""

import torch
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from hyper_parallel.models.common import MoE, SharedExpertMoE

HF_TO_OURS = {
    "gate.weight": "router.weight",
    "experts.gate_up_proj": "experts.gate_up_proj",
    "experts.down_proj": "experts.down_proj",
    "shared_expert.gate_proj.weight": "shared_expert.w1.weight",
    "shared_expert.up_proj.weight": "shared_expert.w3.weight",
    "shared_expert.down_proj.weight": "shared_expert.w2.weight",
    "shared_expert_gate.weight": "shared_expert_gate.weight",
}


def _copy_random_weights(ref, new):
    torch.manual_seed(3)
    with torch.no_grad():
        for param in ref.parameters():
            param.copy_(torch.randn_like(param) * 0.1)
    new.load_state_dict({HF_TO_OURS[k]: v for k, v in ref.state_dict().items()})


def _moe_config(hf_config) -> MoE.Config:
    return MoE.Config(dim=hf_config.hidden_size, hidden_dim=hf_config.moe_intermediate_size,
                      num_experts=hf_config.num_experts, top_k=hf_config.num_experts_per_tok,
                      norm_topk_prob=hf_config.norm_topk_prob)


def test_moe_and_router_match_qwen3_moe_sparse_block(qwen3_moe_config, dtype):
    ref = Qwen3MoeSparseMoeBlock(qwen3_moe_config)
    new = _moe_config(qwen3_moe_config).build()
    _copy_random_weights(ref, new)
    ref, new = ref.to(dtype), new.to(dtype)
    x = torch.randn(2, 8, qwen3_moe_config.hidden_size, dtype=dtype)
    tokens = x.view(-1, qwen3_moe_config.hidden_size)
    for ours, expected in zip(new.router(tokens), ref.gate(tokens)):
        assert torch.equal(ours, expected)  # logits, top-k weights, top-k ids
    _, weights, ids = ref.gate(tokens)
    assert torch.equal(new.experts(tokens, ids, weights), ref.experts(tokens, ids, weights))
    assert torch.equal(new(x), ref(x))


def test_router_without_topk_renormalization(qwen3_moe_config):
    qwen3_moe_config.norm_topk_prob = False
    ref = Qwen3MoeSparseMoeBlock(qwen3_moe_config)
    new = _moe_config(qwen3_moe_config).build()
    _copy_random_weights(ref, new)
    tokens = torch.randn(16, qwen3_moe_config.hidden_size)
    _, ours, _ = new.router(tokens)
    _, expected, _ = ref.gate(tokens)
    assert torch.equal(ours, expected) and not torch.allclose(ours.sum(-1), torch.ones(16))


def test_shared_expert_moe_matches_qwen3_5_moe_sparse_block(dtype):
    hf_config = Qwen3_5MoeTextConfig(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                     num_experts=4, num_experts_per_tok=2)
    hf_config._experts_implementation = "eager"
    ref = Qwen3_5MoeSparseMoeBlock(hf_config)
    new = SharedExpertMoE.Config(dim=64, hidden_dim=32, num_experts=4, top_k=2, shared_hidden_dim=48).build()
    _copy_random_weights(ref, new)
    ref, new = ref.to(dtype), new.to(dtype)
    x = torch.randn(2, 8, 64, dtype=dtype)
    assert torch.equal(new(x), ref(x))


def test_init_states_draws_small_normal_expert_weights():
    moe = MoE.Config(dim=64, hidden_dim=32, num_experts=8, top_k=2).build()
    torch.manual_seed(0)
    moe.init_states()
    for param in (moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj):
        assert 0.015 < param.std().item() < 0.025
