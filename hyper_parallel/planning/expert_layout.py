"""Expert parallel on top of the tensor-parallel roles.

With ``ep > 1`` every packed-experts entry also shards its expert weights on dim 0
(the expert dim) over ``ep``, and the applier installs the all-to-all token dispatch
(``expert_dispatch.py``) on the module. Its inputs and outputs are written as tokens
split over ``ep`` (each ep rank routes its own tokens; ep borrows the dp*cp ranks, so
this replaces the cp token split the sequence layout wrote); the router stays
replicated.
"""

from torch import nn
from torch.distributed.tensor import Shard

from hyper_parallel.distributed.model_parts import positional_names
from hyper_parallel.planning.plan_lint import PlanError
from hyper_parallel.protocols.axes import EP
from hyper_parallel.protocols.sharding import IO_PLACEMENT_FIELDS, ShardingConfig

DISPATCH_INPUTS = 3  # the dispatch takes (hidden_states, top_k_index, top_k_weights), as HF's experts do


def apply_expert_layout(model: nn.Module, modules: dict[str, ShardingConfig], roles: dict[str, str], *,
                        ep: int) -> None:
    if ep <= 1:
        return
    for fqn, role in roles.items():
        if role == "packed_experts":
            _check_dispatchable(fqn, model.get_submodule(fqn), ep)
            _expert_parallel(modules[fqn])


def _check_dispatchable(fqn: str, experts: nn.Module, ep: int) -> None:
    """The token dispatch routes each token by the top-k indices and weights the experts
    module takes; experts whose router was applied before them (Llama 4's take the routed
    hidden states alone) give it nothing to route by. It numbers the experts by the
    module's ``num_experts``, which every packed weight must hold along dim 0 (the dim ep
    splits) and ep must divide: Longcat-Flash's experts have no such count, and their
    gate_up_proj holds rows for zero-compute experts its down_proj lacks."""
    names = positional_names(experts)
    what = f"accelerator.ep_size: {fqn} ({type(experts).__name__})"
    if len(names) < DISPATCH_INPUTS:
        raise PlanError(f"{what} takes ({', '.join(names)}), not the hidden states with the top-k expert indices "
                        "and weights, which expert parallel's token dispatch routes by; expert parallel cannot do "
                        "such experts yet: set ep_size: 1")
    count = getattr(experts, "num_experts", None)
    rows = {name: param.shape[0] for name, param in experts.named_parameters(recurse=False)}
    if not isinstance(count, int) or isinstance(count, bool) or any(n != count for n in rows.values()):
        raise PlanError(f"{what}: expert parallel numbers the experts by the module's num_experts, which every "
                        f"expert weight must hold along dim 0; it has num_experts={count!r} and "
                        f"{', '.join(f'{name} {n}' for name, n in rows.items())}; expert parallel cannot do such "
                        "experts yet: set ep_size: 1")
    if count % ep:
        raise PlanError(f"{what}: ep_size={ep} does not divide its num_experts={count} (experts are split across "
                        "ep ranks)")


def _expert_parallel(config: ShardingConfig) -> None:
    config.state_shardings = {name: {**named, EP: Shard(0)} for name, named in config.state_shardings.items()}
    for key in IO_PLACEMENT_FIELDS:
        value = getattr(config, key)
        if value is not None:
            setattr(config, key, tuple(None if named is None else _tokens_on_ep(named) for named in value))


def _tokens_on_ep(named: dict) -> dict:
    return {**{axis: p for axis, p in named.items() if str(axis) != "cp"}, EP: Shard(0)}
