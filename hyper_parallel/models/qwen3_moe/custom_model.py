"""The custom backend for qwen3_moe: an HF ``Qwen3MoeConfig`` → a ``models/common``
``Decoder`` (same math as ``Qwen3MoeForCausalLM`` with eager attention and experts),
HF weights placed by the weight map (the ``checkpoint_conversion`` that ``Decoder`` and
``TransformerBlock`` declare, composed after transformers' own conversion; see
``models/hf/model_builder.build_custom_model``), and tensor/sequence parallel applied by
``set_decoder_sharding_config`` through the project's one applier.
"""

from typing import Any

import torch

from hyper_parallel.errors import HyperParallelError
from hyper_parallel.models.common import (
    BaseAttention,
    Decoder,
    Embedding,
    FeedForward,
    GQAttention,
    Linear,
    MoE,
    RMSNorm,
    RoPE,
    TransformerBlock,
    set_decoder_sharding_config,
)
from hyper_parallel.protocols import collect_sharding_plan

MODEL_TYPE = "qwen3_moe"


class UnsupportedHFConfigError(ValueError, HyperParallelError):
    """An HF config option the custom backend does not implement."""


def decoder_config_from_hf(hf_config: Any) -> Decoder.Config:
    _check_supported(hf_config)
    dim = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or dim // hf_config.num_attention_heads
    eps = hf_config.rms_norm_eps
    return Decoder.Config(
        tok_embeddings=Embedding.Config(num_embeddings=hf_config.vocab_size, embedding_dim=dim,
                                        padding_idx=hf_config.pad_token_id),
        rope=RoPE.Config(head_dim=head_dim, max_seq_len=hf_config.max_position_embeddings,
                         theta=float(hf_config.rope_parameters["rope_theta"])),
        layers=[TransformerBlock.Config(
            attention=GQAttention.Config(
                dim=dim, n_heads=hf_config.num_attention_heads, n_kv_heads=hf_config.num_key_value_heads,
                head_dim=head_dim, bias=hf_config.attention_bias, qk_norm=True, norm_eps=eps,
                inner_attention=BaseAttention.Config(head_dim=head_dim, dropout=hf_config.attention_dropout)),
            attention_norm=RMSNorm.Config(hidden=dim, eps=eps),
            ffn_norm=RMSNorm.Config(hidden=dim, eps=eps),
            **_ffn_of_layer(hf_config, index),
        ) for index in range(hf_config.num_hidden_layers)],
        norm=RMSNorm.Config(hidden=dim, eps=eps),
        output=Linear.Config(in_features=dim, out_features=hf_config.vocab_size, bias=False),
    )


def _ffn_of_layer(hf_config: Any, index: int) -> dict:
    """HF Qwen3MoeDecoderLayer's rule for which layers are sparse."""
    sparse = (index not in hf_config.mlp_only_layers and hf_config.num_experts > 0
              and (index + 1) % hf_config.decoder_sparse_step == 0)
    if sparse:
        return {"moe": MoE.Config(dim=hf_config.hidden_size, hidden_dim=hf_config.moe_intermediate_size,
                                  num_experts=hf_config.num_experts, top_k=hf_config.num_experts_per_tok,
                                  norm_topk_prob=hf_config.norm_topk_prob)}
    return {"feed_forward": FeedForward.Config(dim=hf_config.hidden_size,
                                               hidden_dim=hf_config.intermediate_size)}


def _check_supported(hf_config: Any) -> None:
    checks = {
        "model_type": (getattr(hf_config, "model_type", None), MODEL_TYPE),
        "hidden_act": (hf_config.hidden_act, "silu"),
        "rope_parameters.rope_type": (hf_config.rope_parameters.get("rope_type", "default"), "default"),
        "use_sliding_window": (bool(getattr(hf_config, "use_sliding_window", False)), False),
    }
    for name, (actual, expected) in checks.items():
        if actual != expected:
            raise UnsupportedHFConfigError(
                f"custom qwen3_moe backend: config {name} is {actual!r}, only {expected!r} is supported")


def build_custom_model(hf_config: Any, *, device: str | torch.device | None = None) -> Decoder:
    """Build (on ``device``, default the current one; ``"meta"`` allocates nothing) and,
    unless on meta, initialize; the lm_head is tied to the embedding when HF ties it."""
    with torch.device(device) if device is not None else _no_context():
        model = decoder_config_from_hf(hf_config).build()
    if getattr(hf_config, "tie_word_embeddings", False):
        model.output.weight = model.tok_embeddings.weight
    if model.output.weight.device.type != "meta":
        model.init_states()
    return model


class _no_context:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def parallelize_custom_model(model: Decoder, mesh: Any, *, loss_parallel: bool, enable_sp: bool,
                             context_parallel: Any = None) -> Decoder:
    """Fill the model's config tree with the declarative plan and apply it with the one
    applier. ``mesh``: a ``MeshContext`` (its dims' ``ep`` > 1 splits the routed experts
    over ep) or a ``DeviceMesh``. With ``loss_parallel`` the logits come back as local
    vocab shards (``Shard(-1)`` on ``tp``). ``context_parallel`` (``config.ContextParallel``,
    effective for the mesh's cp size): allgather_kv or ulysses split each attention over
    cp (the logits come back whole over cp); gather_sequence or None: every cp rank
    computes the whole sequence."""
    from hyper_parallel.distributed.applier import apply_sharding_plan
    from hyper_parallel.distributed.mesh import MeshContext
    from hyper_parallel.distributed.context_parallel import ATTENTION_ROLE

    device_mesh = mesh.device_mesh if isinstance(mesh, MeshContext) else mesh
    cp = _mesh_size(device_mesh, "cp")
    split = context_parallel is not None and context_parallel.splits_attention and cp > 1
    if split and context_parallel.algorithm == "ulysses":
        _check_ulysses_heads(model, _mesh_size(device_mesh, "tp") * cp)
    set_decoder_sharding_config(model.config, loss_parallel=loss_parallel, enable_sp=enable_sp,
                                split_sequence_over_cp=split,
                                expert_parallel=isinstance(mesh, MeshContext) and mesh.dims.ep > 1)
    roles = {fqn: ATTENTION_ROLE[context_parallel.algorithm]
             for fqn, module in model.named_modules() if isinstance(module, GQAttention)} if split else None
    return apply_sharding_plan(model, collect_sharding_plan(model), mesh,
                               context_parallel=context_parallel if split else None, roles=roles)


def _mesh_size(mesh: Any, axis: str) -> int:
    names = tuple(mesh.mesh_dim_names or ())
    return mesh.size(names.index(axis)) if axis in names else 1


def _check_ulysses_heads(model: Decoder, ranks: int) -> None:
    """ulysses gives each of tp*cp ranks a group of query and of kv heads."""
    attention = model.config.layers[0].attention
    for name, heads in (("num_attention_heads", attention.n_heads), ("num_key_value_heads", attention.n_kv_heads)):
        if heads % ranks:
            raise UnsupportedHFConfigError(
                f"accelerator.context_parallel.algorithm: ulysses splits the heads over tp_size*cp_size = {ranks}, "
                f"but the model's {name} is {heads}; use algorithm: allgather_kv, or a tp_size/cp_size whose "
                f"product divides {heads}")
