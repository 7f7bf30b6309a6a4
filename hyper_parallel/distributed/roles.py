"""Tensor-parallel roles: what each kind of module becomes on the ``tp`` axis.

Between modules activations are plain local tensors; each entry says how its inputs
arrive (``in_src``), how the module needs them (``in_dst``) and what it hands on.

| role            | parameters                         | inputs            | outputs                  |
|-----------------|------------------------------------|-------------------|--------------------------|
| colwise         | weight/bias shard(0)               | replicate         | shard(-1), kept local    |
| rowwise         | weight shard(1), bias replicate    | shard(-1)         | partial -> replicate     |
| vocab_embedding | weight shard(0) (vocab rows)       | replicate ids     | partial -> replicate     |
| lm_head         | weight shard(0) (vocab rows)       | replicate         | shard(-1) -> replicate   |
| packed_experts  | gate_up packed_shard, down shard   | replicate         | partial -> replicate     |
| head_norm       | replicate (grads summed over tp)   | shard(-2) (heads) | unchanged (local)        |
| fused_qkv       | weight/bias packed_shard(0,3)      | replicate         | this rank's q, k, v      |
| fused_gate_up   | weight packed_shard(0,2)           | replicate         | this rank's gate, up     |
| projection_norm | replicate                          | shard(-1) -> rep. | replicate -> shard(-1)   |
| replicate       | replicate                          | unchanged         | unchanged                |

Every role but ``vocab_embedding`` (whose out-of-shard ids DTensor masks) and a
``rowwise`` linear with a bias runs as ``local_map``: it computes on local tensors, which
needs no DTensor support from the ops inside (top-k routing, grouped GEMMs, norms) and
costs no DTensor dispatch; the boundary conversions carry the collectives.
"""

from collections.abc import Callable

from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.distributed.plan_lint import PlanError
from hyper_parallel.protocols.sharding import ShardingConfig

COLWISE_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "fc1"})
ROWWISE_NAMES = frozenset({"o_proj", "down_proj", "w2", "fc2", "out_proj"})
# Per-head norms (Qwen3's q_norm/k_norm) run on the head-split projections.
HEAD_NORM_NAMES = frozenset({"q_norm", "k_norm"})
# Fused projections: one Linear whose output packs equal parts ([q | k | v], [gate | up]).
FUSED_QKV_NAMES = frozenset({"qkv_proj", "qkv", "wqkv", "Wqkv"})
FUSED_GATE_UP_NAMES = frozenset({"gate_up_proj", "w13"})
# Small routing / gating linears: replicated, every rank routes all its tokens itself.
ROUTER_NAMES = frozenset({"gate", "router", "shared_expert_gate"})

TP = "tp"


def _on_tp(placement) -> dict:
    return {TP: placement}


def _params(module: nn.Module) -> list[str]:
    return [name for name, _ in module.named_parameters(recurse=False)]


def colwise(module: nn.Module, hints: dict) -> ShardingConfig:
    # A linear on its weight rows is exact on local tensors (no DTensor dispatch per call).
    return ShardingConfig(
        state_shardings={name: _on_tp(Shard(0)) for name in _params(module)},
        in_src=(_on_tp(Replicate()),), in_dst=(_on_tp(Replicate()),),
        out_src=(_on_tp(Shard(-1)),), out_dst=(_on_tp(Shard(-1)),), local_map=True)


def rowwise(module: nn.Module, hints: dict) -> ShardingConfig:
    params = _params(module)
    states = {name: _on_tp(Shard(1) if name == "weight" else Replicate()) for name in params}
    # Locally each rank would add the replicated bias to its partial sum (tp times in the
    # sum), so a linear with a bias computes as DTensor, which adds it once.
    return ShardingConfig(
        state_shardings=states,
        in_src=(_on_tp(Shard(-1)),), in_dst=(_on_tp(Shard(-1)),),
        out_src=(_on_tp(Partial()),), out_dst=(_on_tp(Replicate()),), local_map="bias" not in params)


def vocab_embedding(module: nn.Module, hints: dict) -> ShardingConfig:
    return ShardingConfig(
        state_shardings={name: _on_tp(Shard(0)) for name in _params(module)},
        in_src=(_on_tp(Replicate()),), in_dst=(_on_tp(Replicate()),),
        out_src=(_on_tp(Partial()),), out_dst=(_on_tp(Replicate()),))


def lm_head(module: nn.Module, hints: dict) -> ShardingConfig:
    config = colwise(module, hints)
    config.out_dst = (_on_tp(Replicate()),)  # full logits for the (not yet parallel) loss
    return config


def is_packed_experts(module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    return ("gate_up_proj" in params and "down_proj" in params
            and params["gate_up_proj"].dim() == 3 and params["down_proj"].dim() == 3)


def packed_experts(module: nn.Module, hints: dict) -> ShardingConfig:
    """HF fused experts: gate_up_proj [E, 2I, H] packs gate and up along the intermediate
    dim (chunk(2) after the matmul), down_proj [E, H, I]. Each rank keeps its slice of I
    in both halves, so the local chunk(2) still pairs gate with up; the down projection
    then yields a partial sum over tp."""
    transposed = bool(getattr(module, "is_transposed", False))  # [E, H, 2I] / [E, I, H]
    inter_in, inter_out = (2, 1) if transposed else (1, 2)
    states = {}
    for name in _params(module):
        if name == "gate_up_proj":
            packed = hints.get(name, "packed_colwise") == "packed_colwise"
            states[name] = _on_tp(_StridedShard(inter_in, split_factor=2) if packed else Shard(inter_in))
        elif name == "down_proj":
            states[name] = _on_tp(Shard(inter_out))
        elif name == "gate_up_proj_bias":
            states[name] = _on_tp(_StridedShard(1, split_factor=2))
        else:  # e.g. down_proj_bias: added on every rank it would be summed tp times
            raise PlanError(
                f"{type(module).__name__}: no tensor-parallel layout for expert parameter {name!r}; "
                "give its module a fully specified plan_overrides entry")
    replicated = _on_tp(Replicate())
    return ShardingConfig(
        state_shardings=states,
        in_src=(replicated, replicated, replicated), in_dst=(replicated, replicated, replicated),
        out_src=(_on_tp(Partial()),), out_dst=(_on_tp(Replicate()),),
        local_map=True)


def head_norm(module: nn.Module, hints: dict) -> ShardingConfig:
    # Input is [..., heads, head_dim] with heads split over tp: every rank sees only its
    # heads, so the replicated weight's gradient is a partial sum (the applier sums it).
    heads = _on_tp(Shard(-2))
    return ShardingConfig(
        state_shardings={name: _on_tp(Replicate()) for name in _params(module)},
        in_src=(heads,), in_dst=(heads,), local_map=True)


def _fused_colwise(module: nn.Module, parts: int) -> ShardingConfig:
    # Each rank keeps its slice of every part (packed_shard), so the local output still
    # splits into ``parts`` pieces with chunk(); computed locally, as DTensor would
    # otherwise re-order the strided layout into a plain shard.
    return ShardingConfig(
        state_shardings={name: _on_tp(_StridedShard(0, split_factor=parts)) for name in _params(module)},
        in_src=(_on_tp(Replicate()),), in_dst=(_on_tp(Replicate()),), local_map=True)


def fused_qkv(module: nn.Module, hints: dict) -> ShardingConfig:
    return _fused_colwise(module, 3)


def fused_gate_up(module: nn.Module, hints: dict) -> ShardingConfig:
    return _fused_colwise(module, 2)


def projection_norm(module: nn.Module, hints: dict) -> ShardingConfig:
    # A norm over the whole q/k projection (not per head) needs every head's values:
    # gather the colwise-sharded input, normalize, hand on this rank's slice again.
    return ShardingConfig(
        state_shardings={name: _on_tp(Replicate()) for name in _params(module)},
        in_src=(_on_tp(Shard(-1)),), in_dst=(_on_tp(Replicate()),),
        out_src=(_on_tp(Replicate()),), out_dst=(_on_tp(Shard(-1)),), local_map=True)


def replicate(module: nn.Module, hints: dict) -> ShardingConfig:
    return ShardingConfig(state_shardings={name: _on_tp(Replicate()) for name in _params(module)}, local_map=True)


ROLE_BUILDERS: dict[str, Callable[[nn.Module, dict], ShardingConfig]] = {
    "colwise": colwise,
    "rowwise": rowwise,
    "vocab_embedding": vocab_embedding,
    "lm_head": lm_head,
    "packed_experts": packed_experts,
    "head_norm": head_norm,
    "fused_qkv": fused_qkv,
    "fused_gate_up": fused_gate_up,
    "projection_norm": projection_norm,
    "replicate": replicate,
}
