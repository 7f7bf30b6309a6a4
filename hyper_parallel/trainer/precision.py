"""Where mixed precision's compute cast happens in a training step.

With dp > 1 FSDP2's ``MixedPrecisionPolicy`` casts the all-gathered parameters to the
compute dtype (runtime/assembly.fsdp_mixed_precision). Every other layout (tp, cp,
ep, one rank) keeps its float32 parameters and runs forward and backward under
``torch.autocast``: matmuls and attention in the compute dtype, reductions, norms and the
loss in float32, gradients into the float32 parameters. Autocast rather than a bf16 copy
of the model: no second set of parameters to shard, place and keep in step with the
masters, and it works on DTensor parameters unchanged."""

import contextlib

import torch

from hyper_parallel.config.precision import precision_policy
from hyper_parallel.config.schema import TrainerConfig
from hyper_parallel.models.hf.model_builder import run_device


def compute_context(config: TrainerConfig, *, fsdp_casts: bool) -> contextlib.AbstractContextManager:
    """The context a step's forward and backward run in: autocast to the compute dtype
    when it differs from the parameters' and FSDP2 does not cast (``fsdp_casts``), else
    nothing (the float32 path is unchanged)."""
    policy = precision_policy(config)
    if policy.compute == policy.master or fsdp_casts:
        return contextlib.nullcontext()
    return torch.autocast(device_type=run_device(config).type,
                          dtype=getattr(torch, policy.compute))
