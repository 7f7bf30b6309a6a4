"""Tensor-parallel roles: what each kind of module becomes on the ``tp`` axis.

Between modules activations are plain local tensors; each entry says how its inputs
arrive (``in_src``), how the module needs them (``in_dst``) and what it hands on.

| role                | parameters                         | inputs              | outputs                  |
|---------------------|------------------------------------|---------------------|--------------------------|
| colwise             | weight/bias shard(0)               | replicate           | shard(-1), kept local    |
| colwise_gathered    | weight/bias shard(0)               | replicate           | shard(-1) -> replicate   |
| rowwise             | weight shard(1), bias partial      | shard(-1)           | partial -> replicate     |
| rowwise_split_input | weight shard(1), bias partial      | replicate -> sh(-1) | partial -> replicate     |
| vocab_embedding     | weight shard(0) (vocab rows)       | replicate ids       | partial -> replicate     |
| lm_head             | weight shard(0) (vocab rows)       | replicate           | shard(-1) -> replicate   |
| packed_experts      | gate_up packed_shard, down shard   | replicate           | partial -> replicate     |
| head_norm           | replicate (grads summed over tp)   | shard(-2) (heads)   | unchanged (local)        |
| fused_qkv           | weight/bias packed_shard(0,3)      | replicate           | this rank's q, k, v      |
| fused_gate_up       | weight packed_shard(0,2)           | replicate           | this rank's gate, up     |
| colwise_by_parent   | (placed by its head_split parent)  | replicate           | shard(-1), kept local    |
| projection_norm     | replicate                          | shard(-1) -> rep.   | replicate -> shard(-1)   |
| local_params        | each as its own TP-plan entry says | unchanged           | unchanged                |
| local_params_summed | each as its own TP-plan entry says | replicate           | partial -> replicate     |
| replicate           | replicate                          | unchanged           | unchanged                |
| identity_share      | (none: an identity expert)         | unchanged           | replicate -> partial     |

Every role but ``vocab_embedding`` (whose out-of-shard ids DTensor masks) runs as
``local_map``: it computes on local tensors, which
needs no DTensor support from the ops inside (top-k routing, grouped GEMMs, norms) and
costs no DTensor dispatch; the boundary conversions carry the collectives.

The second half of this module is transformers' tensor-parallel vocabulary read by
meaning (``TP_STYLES``): for every style name, what transformers does to the weights,
which input the module expects, what it hands on, and the role that means the same
here (or why no role does). The planner uses a style only where it agrees with the
module it sits on (``planner.py``).
"""

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.distributed.model_parts import positional_names
from hyper_parallel.planning.plan_lint import PlanError
from hyper_parallel.protocols.axes import TP
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
    # The bias is added to the partial sum, so it is placed ``partial`` (stored whole, added
    # once over tp: the applier's ``_partial_parameter``), and the module computes on local
    # tensors like every other role. DTensor math would add it once too, but infers global
    # shapes from local ones: under cp, an MoE expert's tokens differ in number per rank
    # (none on some), DTensor's propagation then differs per rank, and the ranks' collectives
    # no longer match (a hang).
    states = {name: _on_tp(Shard(1) if name == "weight" else Partial() if name == "bias" else Replicate())
              for name in _params(module)}
    return ShardingConfig(
        state_shardings=states,
        in_src=(_on_tp(Shard(-1)),), in_dst=(_on_tp(Shard(-1)),),
        out_src=(_on_tp(Partial()),), out_dst=(_on_tp(Replicate()),), local_map=True)


def vocab_embedding(module: nn.Module, hints: dict) -> ShardingConfig:
    return ShardingConfig(
        state_shardings={name: _on_tp(Shard(0)) for name in _params(module)},
        in_src=(_on_tp(Replicate()),), in_dst=(_on_tp(Replicate()),),
        out_src=(_on_tp(Partial()),), out_dst=(_on_tp(Replicate()),))


def colwise_gathered(module: nn.Module, hints: dict) -> ShardingConfig:
    """A colwise projection whose consumer needs every feature (OLMo-2's q_norm over the
    whole projection, Phi-3's slicing of its fused qkv and chunk of gate_up): each rank
    computes its rows, the output boundary gathers them, and the next op sees all of them."""
    config = colwise(module, hints)
    config.out_dst = (_on_tp(Replicate()),)
    return config


def lm_head(module: nn.Module, hints: dict) -> ShardingConfig:
    """The output embedding: a gathered colwise projection (full logits for the loss);
    its own role because the sequence layouts and loss parallel rewrite its output."""
    return colwise_gathered(module, hints)


def rowwise_split_input(module: nn.Module, hints: dict) -> ShardingConfig:
    """A rowwise projection whose input arrives full (after a gathered colwise one): the
    input boundary keeps this rank's slice of the features (no data moves forward; the
    backward gathers the input gradient), then it computes as ``rowwise``."""
    config = rowwise(module, hints)
    config.in_src = (_on_tp(Replicate()),)
    return config


def is_packed_experts(module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    return ("gate_up_proj" in params and "down_proj" in params
            and params["gate_up_proj"].dim() == 3 and params["down_proj"].dim() == 3)


def expert_intermediate_dims(module: nn.Module) -> tuple[int, int]:
    """Which dim of ``gate_up_proj`` and of ``down_proj`` holds the intermediate size: read
    from the shapes, [E, 2I, H] with [E, H, I] (HF's layout) or [E, H, 2I] with [E, I, H]
    (transposed: Llama 4, ``is_transposed`` experts). Exactly one of the two fits any
    shapes, so neither a flag nor a TP-plan hint can make the split land on the hidden size."""
    gate_up, down = module.gate_up_proj.shape, module.down_proj.shape
    if gate_up[1] == 2 * down[2] and gate_up[2] == down[1]:
        return 1, 2
    if gate_up[2] == 2 * down[1] and gate_up[1] == down[2]:
        return 2, 1
    raise PlanError(f"{type(module).__name__}: gate_up_proj {list(gate_up)} and down_proj {list(down)} are not "
                    "[E, 2I, H] with [E, H, I] nor [E, H, 2I] with [E, I, H]; give its module a fully specified "
                    "plan_overrides entry")


def packed_experts(module: nn.Module, hints: dict) -> ShardingConfig:
    """HF fused experts: gate_up_proj packs gate and up along the intermediate dim, down_proj
    maps the intermediate dim back. Each rank keeps its slice of I for both gate and up, so
    the local gate/up split still pairs them; the down projection then yields a partial sum
    over tp. Gate and up are concatenated ([gate | up], chunk(2) after the matmul: a
    packed shard keeps this rank's slice of each block) or, where the module says
    ``is_concatenated = False`` (transformers' ``use_experts_implementation``, GPT-OSS),
    interleaved ([g0, u0, g1, u1, ...], split with ``[..., ::2]``: a plain shard keeps
    whole pairs, the same intermediate units as down_proj's shard). The layout comes from
    the shapes (``expert_intermediate_dims``); the parameters' TP-plan styles
    (packed_colwise, packed_rowwise, rowwise, ...) name the same dims for HF's layouts and
    are not needed. ``down_proj_bias`` is added to the down projection's output, which is
    a partial sum here: it is placed ``partial`` (stored whole, added once over tp; see the
    applier)."""
    inter_in, inter_out = expert_intermediate_dims(module)
    interleaved = getattr(module, "is_concatenated", True) is False
    states = {}
    for name in _params(module):
        if name == "gate_up_proj":
            states[name] = _on_tp(Shard(inter_in) if interleaved else _StridedShard(inter_in, split_factor=2))
        elif name == "down_proj":
            states[name] = _on_tp(Shard(inter_out))
        elif name == "gate_up_proj_bias":
            states[name] = _on_tp(Shard(1) if interleaved else _StridedShard(1, split_factor=2))
        elif name == "down_proj_bias":
            states[name] = _on_tp(Partial())
        else:
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


def colwise_by_parent(module: nn.Module, hints: dict) -> ShardingConfig:
    """A projection packing blocks of unequal widths (a gated delta-net's ``[q | k | v]``),
    each split over tp: no placement says that layout, so its parent (``head_split``)
    places the weight (in packed order, or replicated under FSDP2) and hands it this
    rank's rows of every block while it runs (``ShardingConfig.local_slices``). Its output is this rank's rows, so the
    gradient of its replicated input is a partial sum (``out: shard(-1)`` says the work is split)."""
    return ShardingConfig(in_src=(_on_tp(Replicate()),), in_dst=(_on_tp(Replicate()),),
                          out_src=(_on_tp(Shard(-1)),), out_dst=(_on_tp(Shard(-1)),), local_map=True)


def projection_norm(module: nn.Module, hints: dict) -> ShardingConfig:
    # A norm over the whole q/k projection (not per head) needs every head's values:
    # gather the colwise-sharded input, normalize, hand on this rank's slice again.
    return ShardingConfig(
        state_shardings={name: _on_tp(Replicate()) for name in _params(module)},
        in_src=(_on_tp(Shard(-1)),), in_dst=(_on_tp(Replicate()),),
        out_src=(_on_tp(Replicate()),), out_dst=(_on_tp(Shard(-1)),), local_map=True)


def local_params(module: nn.Module, hints: dict) -> ShardingConfig:
    """HF's ``local_params``: a module (attention with per-head sinks) whose own parameters
    are laid out as their own TP-plan entries say and used as local tensors while it runs;
    a parameter without an entry is replicated."""
    states = {name: _on_tp(parameter_placement(hints.get(name), name, param.dim()))
              for name, param in module.named_parameters(recurse=False)}
    return ShardingConfig(state_shardings=states, local_map=True)


def local_params_summed(module: nn.Module, hints: dict) -> ShardingConfig:
    """HF's ``all_reduce`` on a module with parameters of its own (Inkling's shared experts:
    3-d gate/up/down tensors written colwise, colwise, rowwise): each parameter laid out as
    its own entry says, the module computes on local tensors, and its output, a partial sum
    over tp, is all-reduced on the way out (the planner refuses the style where no entry
    splits a parameter: the output would be whole, not a partial sum). Every input is
    declared replicate, not only the first: the split work makes the gradient of each
    one a partial sum (Inkling's routing weights ``gammas`` scale the split intermediate),
    which the input's boundary reduces."""
    config = local_params(module, hints)
    config.in_src = config.in_dst = (_on_tp(Replicate()),) * max(1, len(positional_names(module)))
    config.out_src, config.out_dst = (_on_tp(Partial()),), (_on_tp(Replicate()),)
    return config


def replicate(module: nn.Module, hints: dict) -> ShardingConfig:
    return ShardingConfig(state_shardings={name: _on_tp(Replicate()) for name in _params(module)}, local_map=True)


def identity_share(module: nn.Module, hints: dict) -> ShardingConfig:
    """HF's ``moe_identity_expert``: a zero-compute expert (LongCat's ``nn.Identity``) inside
    experts whose output is a partial sum over tp. Its output is whole on every rank, so the
    sum would count it tp times: it is handed on as one term of that sum (the first tp rank
    whole, the others zeros; ``boundary_collectives.first_rank_share``), and its gradients
    (the input's, the routing weight's) are then counted once by the boundaries that sum
    them. The planner gives this role only inside such experts."""
    return ShardingConfig(out_src=(_on_tp(Replicate()),), out_dst=(_on_tp(Partial()),), local_map=True)


ROLE_BUILDERS: dict[str, Callable[[nn.Module, dict], ShardingConfig]] = {
    "colwise": colwise,
    "rowwise": rowwise,
    "vocab_embedding": vocab_embedding,
    "colwise_gathered": colwise_gathered,
    "rowwise_split_input": rowwise_split_input,
    "lm_head": lm_head,
    "packed_experts": packed_experts,
    "head_norm": head_norm,
    "fused_qkv": fused_qkv,
    "fused_gate_up": fused_gate_up,
    "projection_norm": projection_norm,
    "colwise_by_parent": colwise_by_parent,
    "local_params": local_params,
    "local_params_summed": local_params_summed,
    "replicate": replicate,
    "identity_share": identity_share,
}


# --- transformers' tensor-parallel vocabulary, read by meaning ----------------------------------
#
# What a style is written for (``sits_on``) and what the activations are around it:
LINEAR, EMBEDDING, EXPERTS, NORM, PARAMETER, ANY = "linear", "embedding", "experts", "norm", "parameter", "any"
FULL, SPLIT, SEQUENCE, AS_IS = "full", "split", "sequence", "as is"
# How a parameter-level entry lays out one parameter (``parameter_placement``): rows are
# dim ndim-2 (a vector's only dim), columns the last dim (a ``bias`` is replicated),
# packed ones split inside each of 2 blocks, dim 0 / dim 1 whatever the rank.
ROWS, COLUMNS, PACKED_ROWS, PACKED_COLUMNS, DIM0, DIM1, REPLICATED, EXPERT_DIM = (
    "rows", "columns", "packed rows", "packed columns", "dim 0", "dim 1", "replicated", "expert dim over ep")


@dataclass(frozen=True)
class StyleMeaning:
    """One transformers tensor-parallel style, read for what it does rather than its name.

    ``sits_on``: the kind of module (or parameter) it is written for; ``weights``: what
    transformers does to them; ``expects`` / ``produces``: the activation the module needs
    and the one it hands on: ``FULL`` (every feature on every rank), ``SPLIT`` (this rank's
    features), ``SEQUENCE`` (this rank's tokens), ``AS_IS``. ``role``: the role here that
    means the same; None when none does, ``refused`` saying why. ``param_layout``: the
    placement of a parameter the style is written on directly. ``container_ok``: on a
    module without parameters of its own the style needs nothing here (its children carry
    their own entries)."""

    sits_on: str
    weights: str
    expects: str
    produces: str
    role: str | None = None
    param_layout: str | None = None
    refused: str = ""
    container_ok: bool = True


_MLA_REFUSAL = (
    "which replicates MLA's kv_a_proj_with_mqa and all-reduces the gradient of only the rope slice of its "
    "output (that slice goes straight to the head-split attention, the rest through kv_b_proj, which sums "
    "its own input gradient); no placement of one module says that")
# Roles whose module output is a partial sum over tp, all-reduced on the way out: an
# identity expert inside one hands on its share of that sum (``identity_share``).
PARTIAL_SUM_ROLES = frozenset({"packed_experts", "local_params_summed"})

# Every style transformers 5.24 registers in ``ALL_PARALLEL_STYLES`` (``transformers.distributed``).
TP_STYLES: dict[str, StyleMeaning] = {
    "colwise": StyleMeaning(LINEAR, "rows (output features) split; bias split", FULL, SPLIT,
                            role="colwise", param_layout=ROWS),
    "colwise_gather_output": StyleMeaning(LINEAR, "rows split; output gathered", FULL, FULL,
                                          role="colwise_gathered", param_layout=ROWS),
    "colwise_rep": StyleMeaning(LINEAR, "rows split; output gathered", FULL, FULL,
                                role="colwise_gathered", param_layout=ROWS),
    "rowwise": StyleMeaning(LINEAR, "columns (input features) split; bias replicated, added once", SPLIT, FULL,
                            role="rowwise", param_layout=COLUMNS),
    "rowwise_split_input": StyleMeaning(LINEAR, "columns split; the full input sliced on entry", FULL, FULL,
                                        role="rowwise_split_input", param_layout=COLUMNS),
    "rowwise_rep": StyleMeaning(LINEAR, "columns split; the full input sliced on entry", FULL, FULL,
                                role="rowwise_split_input", param_layout=COLUMNS),
    "packed_colwise": StyleMeaning(LINEAR, "rows split inside each of 2 packed blocks ([gate | up])", FULL, SPLIT,
                                   role="fused_gate_up", param_layout=PACKED_ROWS),
    "packed_rowwise": StyleMeaning(
        PARAMETER, "last dim split inside each of 2 packed blocks (transposed expert gate_up)", AS_IS, AS_IS,
        param_layout=PACKED_COLUMNS,
        refused="a parameter-level style (packed expert weights); on a module transformers shards nothing"),
    "embedding_rowwise": StyleMeaning(EMBEDDING, "rows (vocabulary) split; partial sums all-reduced", FULL, FULL,
                                      role="vocab_embedding", param_layout=DIM0),
    # Same module contract as embedding_rowwise (full ids in, full hidden states out); the
    # table is split by vocabulary rows here, which the output embedding can share when tied.
    "embedding_colwise": StyleMeaning(EMBEDDING, "columns (hidden) split; output gathered", FULL, FULL,
                                      role="vocab_embedding", param_layout=DIM1),
    # The sequence split itself is the sequence layout's (sequence_parallel: true).
    "sequence_parallel": StyleMeaning(NORM, "replicated; input split on the sequence", SEQUENCE, SEQUENCE,
                                      role="replicate", param_layout=REPLICATED),
    "replicated_with_grad_allreduce": StyleMeaning(
        NORM, "replicated; gradients summed over tp (the input is this rank's heads)", SPLIT, SPLIT,
        role="head_norm", param_layout=REPLICATED),
    "mla_kv_a_proj": StyleMeaning(LINEAR, "replicated; the rope slice's gradient all-reduced", FULL, FULL,
                                  refused=_MLA_REFUSAL),
    # A container whose children hand on partial sums (the roles here reduce their own), or a
    # module computing a partial sum from its own parameters, split as their entries say.
    "all_reduce": StyleMeaning(ANY, "untouched; the partial output all-reduced", AS_IS, FULL,
                               role="local_params_summed"),
    "moe_tp_experts": StyleMeaning(EXPERTS, "each expert's intermediate dim split (by the parameters' entries)",
                                   FULL, FULL, role="packed_experts"),
    # On a module without parameters: planned only inside one of PARTIAL_SUM_ROLES (planner).
    "moe_identity_expert": StyleMeaning(ANY, "none; the input divided by tp", FULL, FULL,
                                        role="identity_share", container_ok=False),
    "local_params": StyleMeaning(ANY, "each parameter as its own entry says, used as local tensors", AS_IS, AS_IS,
                                 role="local_params"),
    "replicate": StyleMeaning(ANY, "replicated", AS_IS, AS_IS, role="replicate", param_layout=REPLICATED),
    # Expert-parallel styles (transformers' ep plan); ep is the expert layout's, the tp
    # layout of the expert weights comes from their shapes.
    "grouped_gemm": StyleMeaning(PARAMETER, "expert dim split over ep", AS_IS, AS_IS, role="packed_experts",
                                 param_layout=EXPERT_DIM),
    "ep_dispatch_experts": StyleMeaning(EXPERTS, "whole experts per ep rank; tokens dispatched to them",
                                        FULL, FULL, role="packed_experts"),
}

# Styles of transformers 4.x that remote code written against it may still carry.
LEGACY_TP_STYLES: dict[str, StyleMeaning] = {
    "local_colwise": StyleMeaning(LINEAR, "rows split, computed on local tensors", FULL, SPLIT,
                                  role="colwise", param_layout=ROWS),
    # 4.x left the partial sum for an enclosing ``gather`` module; rowwise reduces it itself
    # and container styles need nothing here, so the pair sums exactly once either way.
    "local_rowwise": StyleMeaning(LINEAR, "columns split, partial output left to an enclosing gather",
                                  SPLIT, FULL, role="rowwise", param_layout=COLUMNS),
    "local_packed_rowwise": StyleMeaning(PARAMETER, "last dim split inside each of 2 packed blocks", AS_IS, AS_IS,
                                         param_layout=PACKED_COLUMNS,
                                         refused="a parameter-level style; on a module it shards nothing"),
    "local": StyleMeaning(EXPERTS, "the module's parameters used as local tensors (experts)", FULL, FULL,
                          role="packed_experts"),
    "gather": StyleMeaning(ANY, "untouched; the partial output all-reduced", AS_IS, FULL,
                           role="local_params_summed"),
    "ep_router": StyleMeaning(LINEAR, "replicated; expert ids outside this ep rank masked", FULL, FULL,
                              role="replicate", param_layout=REPLICATED),
}


def style_meaning(style: str) -> StyleMeaning | None:
    """The meaning of a TP-plan style name; None for a name this planner does not know."""
    return TP_STYLES.get(style) or LEGACY_TP_STYLES.get(style)


def parameter_placement(style: str | None, name: str, ndim: int):
    """The placement on ``tp`` a parameter-level TP-plan entry gives one parameter, as
    transformers lays it out (``param_layout``); no entry: replicated. Expert-dim styles
    place the parameter on ``ep`` (the expert layout's), so on ``tp`` it is replicated."""
    meaning = None if style is None else style_meaning(style)
    if style is not None and (meaning is None or meaning.param_layout is None):
        raise PlanError(f"parameter {name!r}: TP-plan style {style!r} gives no parameter layout; give its "
                        "module a fully specified plan_overrides entry")
    layout = REPLICATED if meaning is None else meaning.param_layout
    rows, last = max(ndim - 2, 0), ndim - 1
    if layout == ROWS:
        return Shard(rows)
    if layout == COLUMNS:
        return Replicate() if name == "bias" else Shard(last)
    if layout == PACKED_ROWS:
        return Shard(0) if ndim == 1 else _StridedShard(rows, split_factor=2)
    if layout == PACKED_COLUMNS:
        return Replicate() if ndim == 1 else _StridedShard(last, split_factor=2)
    if layout in (DIM0, DIM1):
        return Shard(0 if layout == DIM0 else 1)
    return Replicate()  # REPLICATED, EXPERT_DIM
