"""Expert parallel on top of the tensor-parallel roles.

With ``ep > 1`` every packed-experts entry also shards its expert weights on dim 0
(the expert dim) over ``ep``, and the applier installs the all-to-all token dispatch
(``expert_dispatch.py``) on the module. Its inputs and outputs are written as tokens
split over ``ep`` (each ep rank routes its own tokens; ep borrows the dp*cp ranks, so
this replaces the cp token split the sequence layout wrote); the router stays
replicated.
"""

from torch.distributed.tensor import Shard

from hyper_parallel.protocols.sharding import ShardingConfig

EP = "ep"


def apply_expert_layout(modules: dict[str, ShardingConfig], roles: dict[str, str], *, ep: int) -> None:
    if ep <= 1:
        return
    for fqn, role in roles.items():
        if role == "packed_experts":
            _expert_parallel(modules[fqn])


def _expert_parallel(config: ShardingConfig) -> None:
    config.state_shardings = {name: {**named, EP: Shard(0)} for name, named in config.state_shardings.items()}
    for key in ("in_src", "in_dst", "out_src", "out_dst"):
        value = getattr(config, key)
        if value is not None:
            setattr(config, key, tuple(None if named is None else _tokens_on_ep(named) for named in value))


def _tokens_on_ep(named: dict) -> dict:
    return {**{axis: p for axis, p in named.items() if str(axis) != "cp"}, EP: Shard(0)}
