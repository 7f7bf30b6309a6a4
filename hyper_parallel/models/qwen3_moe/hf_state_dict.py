"""HF Qwen3-MoE state dict ↔ the custom backend's (``models/common`` Decoder) names.

The one place that knows how HF names map onto the custom model. Two HF layouts are
accepted for the routed experts:

- fused (transformers ≥ 5 in memory): ``mlp.experts.gate_up_proj`` [E, 2I, H] and
  ``mlp.experts.down_proj`` [E, H, I] — the custom layout, copied as is;
- per expert (the safetensors of the released checkpoints):
  ``mlp.experts.{e}.{gate,up,down}_proj.weight`` — stacked (gate rows, then up rows).
"""

import re

import torch

from hyper_parallel.errors import HyperParallelError

_LAYER = r"model\.layers\.(\d+)\."

# (HF pattern, custom template); the layer index is group 1 where there is one
_KEY_MAP: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens\.weight", "tok_embeddings.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (_LAYER + r"input_layernorm\.weight", r"layers.\1.attention_norm.weight"),
    (_LAYER + r"post_attention_layernorm\.weight", r"layers.\1.ffn_norm.weight"),
    (_LAYER + r"self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.(weight|bias)",
     r"layers.\1.attention.\2.\3"),
    (_LAYER + r"mlp\.gate\.weight", r"layers.\1.moe.router.weight"),
    (_LAYER + r"mlp\.experts\.(gate_up_proj|down_proj)", r"layers.\1.moe.experts.\2"),
    (_LAYER + r"mlp\.gate_proj\.weight", r"layers.\1.feed_forward.w1.weight"),
    (_LAYER + r"mlp\.up_proj\.weight", r"layers.\1.feed_forward.w3.weight"),
    (_LAYER + r"mlp\.down_proj\.weight", r"layers.\1.feed_forward.w2.weight"),
)
_COMPILED = tuple((re.compile(pattern + r"$"), template) for pattern, template in _KEY_MAP)
_PER_EXPERT = re.compile(_LAYER + r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class HFStateDictError(KeyError, HyperParallelError):
    """An HF key or tensor the mapping cannot place."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def hf_key_to_custom(hf_key: str) -> str:
    for pattern, template in _COMPILED:
        match = pattern.match(hf_key)
        if match:
            return match.expand(template)
    raise HFStateDictError(f"HF Qwen3-MoE key {hf_key!r} has no place in the custom model")


def custom_state_dict_from_hf(hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename (and, for per-expert checkpoints, stack) HF tensors into custom names."""
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for key, tensor in hf_state_dict.items():
        match = _PER_EXPERT.match(key)
        if match:
            layer, expert, proj = int(match.group(1)), int(match.group(2)), match.group(3)
            per_expert.setdefault((layer, proj), {})[expert] = tensor
            continue
        out[hf_key_to_custom(key)] = tensor
    out.update(_stack_experts(per_expert))
    return out


def _stack_experts(per_expert: dict[tuple[int, str], dict[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for layer in sorted({layer for layer, _ in per_expert}):
        gate, up, down = (_ordered(per_expert, layer, proj) for proj in ("gate_proj", "up_proj", "down_proj"))
        if not len(gate) == len(up) == len(down):
            raise HFStateDictError(
                f"layer {layer}: per-expert gate/up/down counts differ ({len(gate)}/{len(up)}/{len(down)})")
        prefix = f"layers.{layer}.moe.experts."
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat([g, u], dim=0) for g, u in zip(gate, up)])
        out[prefix + "down_proj"] = torch.stack(down)
    return out


def _ordered(per_expert, layer: int, proj: str) -> list[torch.Tensor]:
    by_index = per_expert.get((layer, proj), {})
    if sorted(by_index) != list(range(len(by_index))):
        raise HFStateDictError(
            f"layer {layer} {proj}: expert indices {sorted(by_index)} are not 0..{len(by_index) - 1}")
    return [by_index[i] for i in range(len(by_index))]


def load_hf_state_dict(model: torch.nn.Module, hf_state_dict: dict[str, torch.Tensor]) -> None:
    """Copy an HF Qwen3-MoE state dict into a custom-backend model; every parameter must
    be covered and every HF tensor used (a tied lm_head may be absent)."""
    custom = custom_state_dict_from_hf(hf_state_dict)
    expected = model.state_dict()
    if "output.weight" not in custom and model.output.weight is model.tok_embeddings.weight:
        expected.pop("output.weight", None)
    missing = sorted(set(expected) - set(custom))
    unexpected = sorted(set(custom) - set(expected))
    if missing or unexpected:
        raise HFStateDictError(f"HF state dict does not fit the custom model: missing {missing}, "
                               f"unexpected {unexpected}")
    for key, tensor in custom.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise HFStateDictError(f"{key}: HF tensor has shape {tuple(tensor.shape)}, "
                                   f"custom model expects {tuple(expected[key].shape)}")
    model.load_state_dict(custom, strict=False)
