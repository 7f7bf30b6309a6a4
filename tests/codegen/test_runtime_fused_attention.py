"""The Qwen3-MoE fused-attention replacement equals HF's eager attention."""

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention, Qwen3MoeRotaryEmbedding

from hyper_parallel.runtime import hyper_apply_replacements
from hyper_parallel.models.qwen3_moe.adapter.replacements import (
    Qwen3MoeFusedAttention,
    replace_qwen3_moe_flash_attention,
)

TINY_CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipes/tiny_cpu/models/tiny-qwen3-moe"
FUSED_ATTENTION = "hyper_parallel.models.qwen3_moe.adapter.replacements.replace_qwen3_moe_flash_attention"
BATCH, SEQ = 2, 7


def tiny_config():
    config = AutoConfig.from_pretrained(TINY_CONFIG_DIR)
    config._attn_implementation = "eager"
    return config


def eager_and_fused(config):
    torch.manual_seed(0)
    eager = Qwen3MoeAttention(config, layer_idx=0).eval()
    for param in eager.parameters():  # norms start at ones; make them matter
        torch.nn.init.normal_(param, std=0.3)
    reference = Qwen3MoeAttention(config, layer_idx=0).eval()
    reference.load_state_dict(eager.state_dict())
    return reference, replace_qwen3_moe_flash_attention(eager)


def inputs(config):
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(BATCH, SEQ, config.hidden_size, generator=generator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    cos_sin = Qwen3MoeRotaryEmbedding(config)(hidden, position_ids)
    return hidden, cos_sin


def causal_masks():
    keep = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    keep = keep[None, None].expand(BATCH, 1, SEQ, SEQ)
    additive = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    return keep, additive


def test_fused_attention_keeps_parameters_fqns_and_shapes():
    reference, fused = eager_and_fused(tiny_config())
    assert isinstance(fused, Qwen3MoeFusedAttention)
    assert [(n, p.shape) for n, p in fused.named_parameters()] == \
        [(n, p.shape) for n, p in reference.named_parameters()]
    assert set(dict(fused.named_children())) == {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_fused_attention_equals_eager_with_causal_masking(mask_kind):
    config = tiny_config()
    reference, fused = eager_and_fused(config)
    hidden, cos_sin = inputs(config)
    keep, additive = causal_masks()
    with torch.no_grad():
        expected, weights = reference(hidden, cos_sin, additive)
        mask = {"none": None, "bool": keep, "additive": additive}[mask_kind]
        actual, no_weights = fused(hidden_states=hidden, position_embeddings=cos_sin, attention_mask=mask,
                                   position_ids=None, use_cache=False)
    assert no_weights is None and weights is not None
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_padding_mask_is_honored():
    config = tiny_config()
    reference, fused = eager_and_fused(config)
    hidden, cos_sin = inputs(config)
    keep, _ = causal_masks()
    keep = keep.clone()
    keep[1, :, :, :2] = False  # the second sequence is left-padded by two tokens
    keep[1, :, :2, :2] = torch.eye(2, dtype=torch.bool)  # padded rows still see something
    additive = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected, _ = reference(hidden, cos_sin, additive)
        actual, _ = fused(hidden, cos_sin, keep)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_fused_attention_gradients_match_eager():
    config = tiny_config()
    reference, fused = eager_and_fused(config)
    hidden, cos_sin = inputs(config)
    _, additive = causal_masks()
    reference(hidden, cos_sin, additive)[0].square().sum().backward()
    fused(hidden, cos_sin, None)[0].square().sum().backward()
    for (name, ref), (_, got) in zip(reference.named_parameters(), fused.named_parameters()):
        # Summation order differs between the kernels: compare at the gradient's own scale.
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-4, atol=1e-5 * ref.grad.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_fused_attention_builds_on_meta():
    with torch.device("meta"):
        attention = Qwen3MoeAttention(tiny_config(), layer_idx=0)
    fused = replace_qwen3_moe_flash_attention(attention)
    assert all(p.is_meta for p in fused.parameters())
    assert fused.q_proj is attention.q_proj


def test_replaced_hf_model_matches_eager_logits():
    config = tiny_config()
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).eval()
    torch.manual_seed(0)
    replaced = AutoModelForCausalLM.from_config(config).eval()
    assert hyper_apply_replacements(replaced, [{"match": "*.self_attn", "target": FUSED_ATTENTION}]) == 2
    input_ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(replaced(input_ids=input_ids).logits, reference(input_ids=input_ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_factory_rejects_static_arguments_and_other_modules():
    with pytest.raises(TypeError, match=r"takes no static arguments, got \['window'\]"):
        replace_qwen3_moe_flash_attention(Qwen3MoeAttention(tiny_config(), 0), window=4)
    with pytest.raises(TypeError, match=r"Linear lacks \[.*'q_proj'.*expected a Qwen3MoeAttention"):
        replace_qwen3_moe_flash_attention(torch.nn.Linear(2, 2))
