"""Expert parallel: route each token to the rank that holds its expert, and back.

An experts module with HF's interface — ``forward(hidden_states [T, H],
top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` and a ``num_experts``
attribute — whose parameters the plan shards on ``ep`` (dim 0, the expert dim) holds
``num_experts / ep`` experts per rank. ``install_expert_dispatch`` wraps its forward:

1. every (token, choice) pair is sent, with its routing weight, to the ep rank owning
   the chosen expert (``all_to_all_single``, differentiable);
2. the module's own forward runs on what arrived, as one choice per row with the
   expert index made local (and ``num_experts`` set to the local count meanwhile);
3. the weighted results travel back (the reverse all-to-all) and are summed per token.

Gradients flow back along the same all-to-alls, so each expert's gradient is complete
over the ep group; the router stays replicated.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from hyper_parallel.platform.host_values import counts_to_host


def install_expert_dispatch(module: nn.Module, fqn: str, group, ep_size: int) -> None:
    total = getattr(module, "num_experts", None)
    if not isinstance(total, int) or total % ep_size:
        raise ValueError(f"{fqn} ({type(module).__name__}): expert parallel needs an integer num_experts "
                         f"divisible by ep={ep_size}, got num_experts={total!r}")
    local_forward = module.forward  # bound: the class's (possibly kernel-dispatching) forward
    local_experts = total // ep_size

    def forward(hidden_states, top_k_index, top_k_weights):
        return _dispatch_and_combine(module, local_forward, hidden_states, top_k_index, top_k_weights,
                                     group, ep_size, local_experts)

    module.forward = forward


def _dispatch_and_combine(module, local_forward, hidden, top_k_index, top_k_weights, group, ep_size: int,
                          local_experts: int):
    tokens, choices = top_k_index.shape
    experts = top_k_index.reshape(-1)
    owner = experts // local_experts
    order = torch.argsort(owner, stable=True)
    token_of = torch.arange(tokens, device=hidden.device).repeat_interleave(choices)[order]
    # Counted into a fixed-size tensor (bincount's size depends on the largest id: no fake-tensor shape)
    send_counts = torch.zeros(ep_size, dtype=torch.long, device=owner.device).index_add_(0, owner, torch.ones_like(owner))
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = counts_to_host(send_counts, tokens * choices), counts_to_host(recv_counts, tokens * choices)

    routed = _exchange(hidden[token_of], recv, send, group)
    weights = _exchange(top_k_weights.reshape(-1)[order].unsqueeze(-1), recv, send, group)
    with torch.no_grad():
        local_index = (experts[order] % local_experts).unsqueeze(-1)
        arrived_index = torch.empty((sum(recv), 1), dtype=local_index.dtype, device=local_index.device)
        dist.all_to_all_single(arrived_index, local_index, recv, send, group=group)

    saved = module.num_experts
    module.num_experts = local_experts
    try:
        computed = local_forward(routed, arrived_index, weights.to(routed.dtype))
    finally:
        module.num_experts = saved
    returned = _exchange(computed, send, recv, group)
    combined = torch.zeros_like(hidden)
    return combined.index_add(0, token_of, returned.to(combined.dtype))


def _exchange(tensor: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    # differentiable: the backward is the reverse all-to-all
    return wait_tensor(all_to_all_single_autograd(tensor.contiguous(), out_splits, in_splits, group))
