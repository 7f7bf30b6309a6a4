"""The run's AdamW: torch's, stepping each DTensor parameter's local shard as a plain tensor.

AdamW is elementwise, so the update of a sharded parameter is its shards' updates: what
DTensor's own dispatch would compute, op for op, without its per-operation sharding
propagation (a dozen Python-level dispatches per parameter per step: most of a 64-rank
thread-mode verify, and the trainer's step on a CPU) and without its refusals: torch's
multi-tensor kernels (``foreach``, one launch per group on an accelerator) cannot mix plain
tensors with DTensors, or DTensors of several meshes (tp and the expert mesh), over plain
local tensors they can. The optimizer's state stays what torch's AdamW keeps for DTensor
parameters (moments as DTensors of the parameter's placements), so checkpoints (DCP's
``get_optimizer_state_dict``) see the same state. A gradient placed otherwise than its
parameter (a partial sum still pending) is redistributed to the parameter's placements
first. The trainer and verify build it here, so verify proves the update that training runs.
"""

import torch
from torch.distributed.tensor import DTensor


class LocalShardAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose step runs on local shards (module docstring)."""

    def _init_group(self, group, *arguments):
        """torch's gathering of the group's tensors (which creates the state on first use, as
        DTensors like their parameters), then each one's local shard in its place: the
        step that follows runs torch's update on those. The lists come in torch's order
        (parameters, gradients, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps); an older
        torch whose AdamW was not Adam's subclass passed its ``amsgrad`` flag among them."""
        has_complex = super()._init_group(group, *arguments)
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, _steps = [a for a in arguments if isinstance(a, list)]
        grads[:] = [_local_gradient(grad, param) for grad, param in zip(grads, params, strict=True)]
        for tensors in (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs):
            tensors[:] = [_local(tensor) for tensor in tensors]
        return has_complex


def build_adamw(params, *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                weight_decay: float = 0.01) -> LocalShardAdamW:
    """The run's AdamW over ``params``; ``foreach=None``: torch picks its multi-tensor kernels
    where it has them (accelerators), its per-parameter loop on the CPU."""
    return LocalShardAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, foreach=None)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard (a view of the same storage: in-place updates reach the DTensor)."""
    return tensor.detach().to_local() if isinstance(tensor, DTensor) else tensor


def _local_gradient(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad``'s local shard, placed as ``param`` is."""
    if isinstance(grad, DTensor):
        if tuple(grad.placements) != tuple(param.placements):
            grad = grad.redistribute(param.device_mesh, param.placements)
        return grad.to_local()
    return grad
