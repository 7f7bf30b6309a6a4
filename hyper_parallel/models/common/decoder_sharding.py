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
  on local tensors (``local_map``; their routing ops have no DTensor rules). With
  ``expert_parallel`` the experts are split over ``ep`` too (dim 0), on the expert mesh.

Context parallel that splits attention (``allgather_kv`` / ``ulysses``, helper argument
``split_sequence_over_cp``): the tokens are split over ``cp`` as they enter the embedding
(``Shard(1)``; load-balanced by the applier when asked), every activation placement
names ``cp`` too (the token dim: 1 of ``[b, s, ...]``, 2 of the per-head ``[b, heads, s,
d]``, 0 of the MoE's flattened ``[tokens, ...]``), so a replicated weight's gradient is
summed over cp, ``BaseAttention`` does the cp work itself, and the logits are gathered
over cp on the way out. Without it every placement names ``tp`` only and each cp rank
computes the whole sequence.
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
EP = MeshAxisName.EP


def dense_param_placement(*, tp: Placement) -> NamedPlacement:
    """Placement of a dense (non-expert) parameter: ``{tp: tp}``."""
    return {TP: tp}


def dense_activation_placement(*, tp: Placement, cp: Placement | None = Shard(1)) -> NamedPlacement:
    """Placement of an activation on the tp (and, unless ``cp`` is None, cp) axes."""
    return {TP: tp} if cp is None else {TP: tp, CP: cp}


def _act(placement: Placement, tokens: int | None) -> NamedPlacement:
    """An activation ``placement`` on tp; with ``tokens`` (the token dim) split over cp there."""
    return dense_activation_placement(tp=placement, cp=None if tokens is None else Shard(tokens))


def _whole_sequence(placement: Placement, tokens: int | None) -> NamedPlacement:
    """An activation ``placement`` on tp that holds the whole sequence on every cp rank
    (named ``Replicate`` on cp where the plan splits over cp, so the applier splits or
    gathers it there)."""
    return dense_activation_placement(tp=placement, cp=None if tokens is None else Replicate())


def _replicated_state(*names: str) -> dict[str, NamedPlacement]:
    return {name: dense_param_placement(tp=Replicate()) for name in names}


def colwise_config(*, tokens: int | None = None) -> ShardingConfig:
    return ShardingConfig(
        state_shardings={"weight": dense_param_placement(tp=Shard(0)),
                         "bias": dense_param_placement(tp=Shard(0))},
        in_src=_act(Replicate(), tokens), in_dst=_act(Replicate(), tokens),
        out_src=_act(Shard(-1), tokens), out_dst=_act(Shard(-1), tokens),
    )


def rowwise_config(*, output_sp: bool, tokens: int | None = None) -> ShardingConfig:
    return ShardingConfig(
        state_shardings={"weight": dense_param_placement(tp=Shard(1)),
                         "bias": dense_param_placement(tp=Replicate())},
        in_src=_act(Shard(-1), tokens), in_dst=_act(Shard(-1), tokens),
        out_src=_act(Partial(), tokens), out_dst=_act(Shard(1) if output_sp else Replicate(), tokens),
    )


def norm_config(*, enable_sp: bool, tokens: int | None = None) -> ShardingConfig:
    return _replicated_weight_config(_act(Shard(1) if enable_sp else Replicate(), tokens))


def _replicated_weight_config(io: NamedPlacement) -> ShardingConfig:
    """A replicated ``weight`` on an activation that arrives and leaves as ``io``."""
    return ShardingConfig(state_shardings=_replicated_state("weight"),
                          in_src=dict(io), in_dst=dict(io), out_src=dict(io), out_dst=dict(io))


def _for_linear(config: ShardingConfig, linear_cfg: Linear.Config) -> ShardingConfig:
    """Drop the bias entry of a linear that has no bias (the applier sees real names only)."""
    if not linear_cfg.bias:
        config.state_shardings.pop("bias", None)
    return config


def set_qkv_linear_sharding(qkv_cfg: GQAttention.Config, *, tokens: int | None = None) -> None:
    for proj in (qkv_cfg.q_proj, qkv_cfg.k_proj, qkv_cfg.v_proj):
        proj.sharding_config = _for_linear(colwise_config(tokens=tokens), proj)


def set_gqa_attention_sharding(attn_cfg: GQAttention.Config, *, enable_sp: bool,
                               split_sequence_over_cp: bool = False) -> None:
    """With ``split_sequence_over_cp`` the block keeps this rank's tokens (``BaseAttention``
    gathers K/V or exchanges heads over cp itself)."""
    tokens = 1 if split_sequence_over_cp else None
    x_arrives = _act(Shard(1) if enable_sp else Replicate(), tokens)
    # inputs: (x, cos, sin); the rope tables are plain tensors for the whole sequence and stay so
    # With the tokens split the block runs on local tensors (local_map): its reshapes to
    # heads take the local sequence length, which a DTensor input would give globally.
    attn_cfg.sharding_config = ShardingConfig(in_src=(x_arrives, None, None),
                                              in_dst=(_act(Replicate(), tokens), None, None),
                                              local_map=tokens is not None)
    set_qkv_linear_sharding(attn_cfg, tokens=tokens)
    attn_cfg.o_proj.sharding_config = _for_linear(rowwise_config(output_sp=enable_sp, tokens=tokens),
                                                  attn_cfg.o_proj)
    if attn_cfg.qk_norm:
        # per-head norms act on [b, s, heads, head_dim], heads split by the colwise q/k_proj
        attn_cfg.q_norm.sharding_config = _replicated_weight_config(_act(Shard(2), tokens))
        attn_cfg.k_norm.sharding_config = _replicated_weight_config(_act(Shard(2), tokens))
    heads = _act(Shard(1), None if tokens is None else 2)  # [b, heads, s, d]
    out = _act(Shard(2), tokens)  # [b, s, heads, d]
    attn_cfg.inner_attention.sharding_config = ShardingConfig(
        in_src=(heads, heads, heads, None, None), in_dst=(heads, heads, heads, None, None),
        out_src=out, out_dst=dict(out), local_map=True,
    )


def set_dense_ffn_sharding(ffn_cfg: FeedForward.Config, *, attn_x_placement: NamedPlacement,
                           enable_sp: bool, tokens: int | None = None) -> None:
    """``attn_x_placement``: how the FFN input arrives (the residual stream's layout);
    ``tokens``: the input's token dim where it is split over cp (None: not split)."""
    ffn_cfg.sharding_config = ShardingConfig(in_src=attn_x_placement, in_dst=_act(Replicate(), tokens))
    ffn_cfg.w1.sharding_config = _for_linear(colwise_config(tokens=tokens), ffn_cfg.w1)
    ffn_cfg.w3.sharding_config = _for_linear(colwise_config(tokens=tokens), ffn_cfg.w3)
    ffn_cfg.w2.sharding_config = _for_linear(rowwise_config(output_sp=enable_sp, tokens=tokens), ffn_cfg.w2)


def _set_moe_sharding(moe_cfg: MoE.Config, *, x_placement: NamedPlacement, enable_sp: bool,
                      tokens: int | None = None, expert_parallel: bool = False) -> None:
    """``tokens``: the sequence dim of the MoE's input where it is split over cp; inside,
    the router and experts see the tokens flattened (dim 0). ``expert_parallel``: the
    experts are split over ``ep`` (dim 0 of both weights) and live on the expert mesh,
    where each rank's tokens are its own (``Shard(0)`` on ep) and the applier's dispatch
    sends them to the rank holding their expert."""
    flat = None if tokens is None else 0
    replicate, flat_replicate = _act(Replicate(), tokens), _act(Replicate(), flat)
    moe_cfg.sharding_config = ShardingConfig(  # local_map with cp: it flattens the local tokens
        in_src=x_placement, in_dst=replicate,
        out_src=replicate, out_dst=_act(Shard(1), tokens) if enable_sp else replicate,
        local_map=tokens is not None,
    )
    moe_cfg.router.sharding_config = ShardingConfig(
        state_shardings=_replicated_state("weight"), in_src=replicate, in_dst=replicate,
        out_src=(flat_replicate,) * 3, out_dst=(flat_replicate,) * 3, local_map=True,
    )
    experts = {"gate_up_proj": dense_param_placement(tp=_StridedShard(1, split_factor=2)),
               "down_proj": dense_param_placement(tp=Shard(2))}
    arrive, partial = flat_replicate, _act(Partial(), flat)
    if expert_parallel:
        experts = {name: {**placement, EP: Shard(0)} for name, placement in experts.items()}
        arrive, partial = {TP: Replicate(), EP: Shard(0)}, {TP: Partial(), EP: Shard(0)}
    moe_cfg.experts.sharding_config = ShardingConfig(
        state_shardings=experts, in_src=(arrive,) * 3, in_dst=(arrive,) * 3,
        out_src=partial, out_dst=dict(arrive), local_map=True,
    )
    if isinstance(moe_cfg, SharedExpertMoE.Config):
        set_dense_ffn_sharding(moe_cfg.shared_expert, attn_x_placement=flat_replicate, enable_sp=False, tokens=flat)
        moe_cfg.shared_expert_gate.sharding_config = _replicated_weight_config(flat_replicate)


def set_decoder_sharding_config(cfg: Decoder.Config, *, loss_parallel: bool, enable_sp: bool,
                                split_sequence_over_cp: bool = False, expert_parallel: bool = False) -> None:
    """The whole decoder's plan. With ``split_sequence_over_cp`` the tokens are split over
    cp at the embedding's input and the logits gathered over cp at the output's; with
    ``expert_parallel`` the routed experts are split over ep."""
    tokens = 1 if split_sequence_over_cp else None
    residual = _act(Shard(1) if enable_sp else Replicate(), tokens)
    cfg.tok_embeddings.sharding_config = ShardingConfig(
        state_shardings={"weight": dense_param_placement(tp=Shard(0))},
        in_src=_whole_sequence(Replicate(), tokens),
        in_dst=_act(Replicate(), tokens),
        out_src=_act(Partial(), tokens), out_dst=residual,
    )
    for layer in cfg.layers:
        layer.attention_norm.sharding_config = norm_config(enable_sp=enable_sp, tokens=tokens)
        layer.ffn_norm.sharding_config = norm_config(enable_sp=enable_sp, tokens=tokens)
        set_gqa_attention_sharding(layer.attention, enable_sp=enable_sp, split_sequence_over_cp=bool(tokens))
        if layer.moe is not None:
            _set_moe_sharding(layer.moe, x_placement=residual, enable_sp=enable_sp, tokens=tokens,
                              expert_parallel=expert_parallel)
        else:
            set_dense_ffn_sharding(layer.feed_forward, attn_x_placement=residual, enable_sp=enable_sp,
                                   tokens=tokens)
    cfg.norm.sharding_config = norm_config(enable_sp=enable_sp, tokens=tokens)
    output = colwise_config(tokens=tokens)
    output.in_src = residual
    output.out_dst = _whole_sequence(Shard(-1) if loss_parallel else Replicate(), tokens)
    cfg.output.sharding_config = _for_linear(output, cfg.output)
