"""Declarative sharding for ``Decoder`` configs (torchtitan's decoder_sharding helpers).

The helpers only write ``sharding_config`` fields into a config tree; the one applier
(``hyper_parallel.distributed.applier``) turns them into DTensors and hooks. Between
modules activations are plain local tensors: a module's inputs are wrapped as
``in_src`` and redistributed to ``in_dst``, its outputs redistributed to ``out_dst``
and unwrapped. So every module that owns a DTensor parameter declares its inputs and
outputs. Placements follow torchtitan's tensor/sequence parallel styles on ``tp``:

- colwise linear: weight/bias ``Shard(0)``; input gathered to ``Replicate``; output
  ``Shard(-1)`` (heads / hidden units stay split into the next op).
- rowwise linear: weight ``Shard(1)``, bias ``Replicate``; input ``Shard(-1)``; output
  ``Partial`` reduced to ``Shard(1)`` (sequence parallel) or ``Replicate``.
- norms: weight ``Replicate``; input/output ``Shard(1)`` (sequence) with sequence
  parallel, ``Replicate`` without.
- attention: input gathered to ``Replicate``; q/k/v colwise, o_proj rowwise; the
  per-head q/k norms see ``[b, s, heads, head_dim]`` sharded on heads (dim 2); the
  score/softmax core runs on local head shards (``local_map``, heads = dim 1 there).
- embedding: vocab-parallel (weight ``Shard(0)``, output ``Partial`` → residual layout).
- output (lm_head): colwise; logits ``Shard(-1)`` with loss parallel, else ``Replicate``.
- MoE (not in the RFC's list; needed by every Qwen3-MoE layer): input gathered to
  ``Replicate``; the router replicated over ``tp``; the experts tensor parallel like a
  colwise/rowwise pair: each rank keeps its slice of the intermediate dim in both the
  gate and the up half of ``gate_up_proj`` (``_StridedShard(1, split_factor=2)``, so the
  local ``chunk(2)`` still pairs gate with up) and in ``down_proj`` (``Shard(2)``), and
  the experts' output, a partial sum over ``tp``, is reduced to ``Replicate``. Both run
  on local tensors (``local_map``; their routing ops have no DTensor rules). Expert
  parallelism, which would split the experts themselves, is outside these helpers.

Activation placements name only the ``tp`` axis: context parallel needs attention to
gather K/V, which these components do not do yet.
"""

from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.models.common.attention import GQAttention
from hyper_parallel.models.common.decoder import Decoder
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.moe import MoE, SharedExpertMoE
from hyper_parallel.protocols import MeshAxisName, NamedPlacement, ShardingConfig

TP = MeshAxisName.TP
CP = MeshAxisName.CP


def dense_param_placement(*, tp: Placement) -> NamedPlacement:
    """Placement of a dense (non-expert) parameter: ``{tp: tp}``."""
    return {TP: tp}


def dense_activation_placement(*, tp: Placement, cp: Placement | None = Shard(1)) -> NamedPlacement:
    """Placement of an activation on the tp (and, unless ``cp`` is None, cp) axes."""
    return {TP: tp} if cp is None else {TP: tp, CP: cp}


def _tp(placement: Placement) -> NamedPlacement:
    return dense_activation_placement(tp=placement, cp=None)


def _replicated_state(*names: str) -> dict[str, NamedPlacement]:
    return {name: dense_param_placement(tp=Replicate()) for name in names}


def colwise_config() -> ShardingConfig:
    return ShardingConfig(
        state_shardings={"weight": dense_param_placement(tp=Shard(0)),
                         "bias": dense_param_placement(tp=Shard(0))},
        in_src=_tp(Replicate()), in_dst=_tp(Replicate()),
        out_src=_tp(Shard(-1)), out_dst=_tp(Shard(-1)),
    )


def rowwise_config(*, output_sp: bool) -> ShardingConfig:
    return ShardingConfig(
        state_shardings={"weight": dense_param_placement(tp=Shard(1)),
                         "bias": dense_param_placement(tp=Replicate())},
        in_src=_tp(Shard(-1)), in_dst=_tp(Shard(-1)),
        out_src=_tp(Partial()), out_dst=_tp(Shard(1) if output_sp else Replicate()),
    )


def norm_config(*, enable_sp: bool) -> ShardingConfig:
    return _replicated_weight_config(_tp(Shard(1) if enable_sp else Replicate()))


def _replicated_weight_config(io: NamedPlacement) -> ShardingConfig:
    """A replicated ``weight`` on an activation that arrives and leaves as ``io``."""
    return ShardingConfig(state_shardings=_replicated_state("weight"),
                          in_src=dict(io), in_dst=dict(io), out_src=dict(io), out_dst=dict(io))


def _for_linear(config: ShardingConfig, linear_cfg: Linear.Config) -> ShardingConfig:
    """Drop the bias entry of a linear that has no bias (the applier sees real names only)."""
    if not linear_cfg.bias:
        config.state_shardings.pop("bias", None)
    return config


def set_qkv_linear_sharding(qkv_cfg: GQAttention.Config) -> None:
    for proj in (qkv_cfg.q_proj, qkv_cfg.k_proj, qkv_cfg.v_proj):
        proj.sharding_config = _for_linear(colwise_config(), proj)


def set_gqa_attention_sharding(attn_cfg: GQAttention.Config, *, enable_sp: bool) -> None:
    x_arrives = _tp(Shard(1) if enable_sp else Replicate())
    # inputs: (x, cos, sin); the rope tables are plain tensors and stay so
    attn_cfg.sharding_config = ShardingConfig(in_src=(x_arrives, None, None),
                                              in_dst=(_tp(Replicate()), None, None))
    set_qkv_linear_sharding(attn_cfg)
    attn_cfg.o_proj.sharding_config = _for_linear(rowwise_config(output_sp=enable_sp), attn_cfg.o_proj)
    if attn_cfg.qk_norm:
        # per-head norms act on [b, s, heads, head_dim], heads split by the colwise q/k_proj
        attn_cfg.q_norm.sharding_config = _replicated_weight_config(_tp(Shard(2)))
        attn_cfg.k_norm.sharding_config = _replicated_weight_config(_tp(Shard(2)))
    heads = _tp(Shard(1))
    attn_cfg.inner_attention.sharding_config = ShardingConfig(
        in_src=(heads, heads, heads, None, None), in_dst=(heads, heads, heads, None, None),
        out_src=_tp(Shard(2)), out_dst=_tp(Shard(2)), local_map=True,
    )


def set_dense_ffn_sharding(ffn_cfg: FeedForward.Config, *, attn_x_placement: NamedPlacement,
                           enable_sp: bool) -> None:
    """``attn_x_placement``: how the FFN input arrives (the residual stream's layout)."""
    ffn_cfg.sharding_config = ShardingConfig(in_src=attn_x_placement, in_dst=_tp(Replicate()))
    ffn_cfg.w1.sharding_config = _for_linear(colwise_config(), ffn_cfg.w1)
    ffn_cfg.w3.sharding_config = _for_linear(colwise_config(), ffn_cfg.w3)
    ffn_cfg.w2.sharding_config = _for_linear(rowwise_config(output_sp=enable_sp), ffn_cfg.w2)


def _set_moe_sharding(moe_cfg: MoE.Config, *, x_placement: NamedPlacement, enable_sp: bool) -> None:
    replicate = _tp(Replicate())
    moe_cfg.sharding_config = ShardingConfig(
        in_src=x_placement, in_dst=replicate,
        out_src=replicate, out_dst=_tp(Shard(1)) if enable_sp else replicate,
    )
    moe_cfg.router.sharding_config = ShardingConfig(
        state_shardings=_replicated_state("weight"), in_src=replicate, in_dst=replicate,
        out_src=(replicate, replicate, replicate), out_dst=(replicate, replicate, replicate),
        local_map=True,
    )
    moe_cfg.experts.sharding_config = ShardingConfig(
        state_shardings={"gate_up_proj": dense_param_placement(tp=_StridedShard(1, split_factor=2)),
                         "down_proj": dense_param_placement(tp=Shard(2))},
        in_src=(replicate, replicate, replicate), in_dst=(replicate, replicate, replicate),
        out_src=_tp(Partial()), out_dst=replicate, local_map=True,
    )
    if isinstance(moe_cfg, SharedExpertMoE.Config):
        set_dense_ffn_sharding(moe_cfg.shared_expert, attn_x_placement=replicate, enable_sp=False)
        moe_cfg.shared_expert_gate.sharding_config = _replicated_weight_config(replicate)


def set_decoder_sharding_config(cfg: Decoder.Config, *, loss_parallel: bool, enable_sp: bool) -> None:
    residual = _tp(Shard(1) if enable_sp else Replicate())
    cfg.tok_embeddings.sharding_config = ShardingConfig(
        state_shardings={"weight": dense_param_placement(tp=Shard(0))},
        in_src=_tp(Replicate()), in_dst=_tp(Replicate()),
        out_src=_tp(Partial()), out_dst=residual,
    )
    for layer in cfg.layers:
        layer.attention_norm.sharding_config = norm_config(enable_sp=enable_sp)
        layer.ffn_norm.sharding_config = norm_config(enable_sp=enable_sp)
        set_gqa_attention_sharding(layer.attention, enable_sp=enable_sp)
        if layer.moe is not None:
            _set_moe_sharding(layer.moe, x_placement=residual, enable_sp=enable_sp)
        else:
            set_dense_ffn_sharding(layer.feed_forward, attn_x_placement=residual, enable_sp=enable_sp)
    cfg.norm.sharding_config = norm_config(enable_sp=enable_sp)
    output = colwise_config()
    output.in_src = residual
    output.out_dst = _tp(Shard(-1) if loss_parallel else Replicate())
    cfg.output.sharding_config = _for_linear(output, cfg.output)
