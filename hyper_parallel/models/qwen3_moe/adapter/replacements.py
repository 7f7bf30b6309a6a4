"""Module replacements for Qwen3-MoE, used as recipe ``replace_module`` targets.

``replace_qwen3_moe_grouped_experts`` swaps ``Qwen3MoeExperts`` for the generic grouped
experts (``components/modules/grouped_experts.py``), which compute the same with grouped
matmuls and a hand-written backward.

``replace_qwen3_moe_flash_attention`` swaps ``Qwen3MoeAttention`` for an attention that
calls the fused kernel of the device: ``torch_npu.npu_fusion_attention`` on Ascend NPUs,
``torch.nn.functional.scaled_dot_product_attention`` elsewhere. The new module adopts
the old one's projections and norms (same objects, so same FQNs, shapes and weights):
the sharding plan derived on the replaced model is the plan of the original one.
Under context parallel with ``allgather_kv`` it gathers its K/V over cp itself
(``distributed.context_parallel.gather_kv``; a no-op without cp), as transformers'
attention functions do through the applier's wrapper.
"""

import torch
from torch import nn
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, apply_rotary_pos_emb

from hyper_parallel.components.modules.grouped_experts import (
    GroupedExperts,
    grouped_experts_class_for,
    replace_with_grouped_experts,
)
from hyper_parallel.distributed.context_parallel import causal_without_mask, gather_kv

# transformers' own Qwen3MoeExperts as grouped experts, importable by name.
GroupedQwen3MoeExperts = grouped_experts_class_for(Qwen3MoeExperts)


def replace_qwen3_moe_grouped_experts(module: nn.Module, **kwargs) -> GroupedExperts:
    """``replace_module`` target for ``Qwen3MoeExperts`` (HF's or a generated file's copy):
    the grouped experts, which are also a ``type(module)``; ``kwargs`` as
    :func:`replace_with_grouped_experts` takes them (``max_padding_ratio``, ``layout``)."""
    return replace_with_grouped_experts(module, **kwargs)


_ADOPTED_CHILDREN = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_ADOPTED_ATTRIBUTES = ("config", "layer_idx", "head_dim", "num_key_value_groups", "scaling",
                       "attention_dropout", "is_causal", "sliding_window")
# npu_fusion_attention sparse_mode 3: causal mask aligned to the bottom right, given as a
# compressed 2048x2048 upper-triangular mask (the kernel's documented convention).
_NPU_CAUSAL_SPARSE_MODE = 3
_NPU_COMPRESSED_MASK_SIZE = 2048


class Qwen3MoeFusedAttention(nn.Module):
    """``Qwen3MoeAttention`` with a fused attention kernel; same parameters and forward
    signature, returns ``(attn_output, None)`` (fused kernels give no weights)."""

    # allgather_kv may plan it: forward gathers K/V over cp (sequence_layout.KV_GATHER_MARK)
    hyper_gathers_kv_over_cp = True

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        for name in _ADOPTED_ATTRIBUTES:
            setattr(self, name, getattr(original, name))
        for name in _ADOPTED_CHILDREN:
            setattr(self, name, getattr(original, name))
        self.training = original.training

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, cache=None, past_key_values=None,
                **kwargs) -> tuple[torch.Tensor, None]:
        cache = cache if cache is not None else past_key_values
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        dropout = self.attention_dropout if self.training else 0.0
        # context parallel (allgather_kv) on CPU, causal: mask-free chunks against every rank's K/V
        out = causal_without_mask(self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling,
                                  sliding_window=self.sliding_window)
        if out is not None:
            return self.o_proj(out.reshape(*input_shape, -1).contiguous()), None
        # else every rank's K/V, and the mask rows of this rank's queries
        key, value, attention_mask = gather_kv(self, query, key, value, attention_mask,
                                               sliding_window=self.sliding_window)

        # Grouped-query attention: each key/value head serves num_key_value_groups query heads.
        key = repeat_kv(key, self.num_key_value_groups)
        value = repeat_kv(value, self.num_key_value_groups)
        if query.device.type == "npu":
            out = _npu_attention(query, key, value, attention_mask, self.scaling, dropout)
        else:
            out = _sdpa_attention(query, key, value, attention_mask, self.scaling, dropout)

        out = out.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), None


def replace_qwen3_moe_flash_attention(module: nn.Module, **kwargs) -> nn.Module:
    """``replace_module`` factory: a :class:`Qwen3MoeFusedAttention` built from ``module``."""
    if kwargs:
        raise TypeError(f"replace_qwen3_moe_flash_attention takes no static arguments, got {sorted(kwargs)}")
    missing = [name for name in _ADOPTED_CHILDREN + _ADOPTED_ATTRIBUTES if not hasattr(module, name)]
    if missing:
        raise TypeError(f"replace_qwen3_moe_flash_attention: {type(module).__name__} lacks {missing}; "
                        f"expected a Qwen3MoeAttention")
    return Qwen3MoeFusedAttention(module)


def _sdpa_attention(query, key, value, attention_mask, scaling, dropout):
    """Queries (batch, heads, q_len, dim) against keys/values (batch, heads, kv_len, dim).
    Without a mask the attention is causal; HF's masks (bool: True keeps, or additive
    float) are already causal and are used as given."""
    kv_len = key.shape[-2]
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, :kv_len]
    # A single query token (decoding) sees the whole cache; is_causal would hide it.
    is_causal = attention_mask is None and query.shape[-2] > 1
    if is_causal and kv_len > query.shape[-2]:
        # Prefill into an empty static cache: the extra key slots are empty (as HF does).
        key, value = key[:, :, :query.shape[-2]], value[:, :, :query.shape[-2]]
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal)


def _npu_attention(query, key, value, attention_mask, scaling, dropout):
    """The same contract on Ascend through ``torch_npu.npu_fusion_attention`` (BNSD layout;
    its ``atten_mask`` marks the positions to *drop*)."""
    import torch_npu  # only present, and only needed, on NPU machines

    if attention_mask is None:
        mask = torch.triu(torch.ones(_NPU_COMPRESSED_MASK_SIZE, _NPU_COMPRESSED_MASK_SIZE,
                                     dtype=torch.bool, device=query.device), diagonal=1)
        sparse_mode = _NPU_CAUSAL_SPARSE_MODE
    else:
        mask = attention_mask[:, :, :, :key.shape[-2]]
        mask = ~mask if mask.dtype == torch.bool else mask.bool()  # HF: True / 0.0 keeps a position
        sparse_mode = 0
    return torch_npu.npu_fusion_attention(
        query, key, value, query.shape[1], input_layout="BNSD", atten_mask=mask, scale=scaling,
        keep_prob=1.0 - dropout, sparse_mode=sparse_mode)[0]
