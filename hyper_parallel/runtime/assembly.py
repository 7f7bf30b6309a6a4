"""The runtime's part of a parallelized model, after the bundle's plan: activation
checkpointing, ``torch.compile`` of the decoder layers, FSDP2 ``fully_shard`` over dp.

Training (models/hf/auto_model.py, with the recipe's options) and verify
(codegen/check/verify_worker.py: fp32, no checkpointing or compile, since it proves the
plan) both finish their model here, so the FSDP2 units, the expert groups' own mesh and
their gradient division that verify proves are the ones training runs.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hyper_parallel.config.precision import precision_policy
from hyper_parallel.config.schema import TrainerConfig
from hyper_parallel.distributed.mesh import MeshContext
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.platform.host_values import outside_fake_tensors
from hyper_parallel.runtime.compile import compile_decoder_layers


class AssemblyError(ValueError, HyperParallelError):
    """A recipe asks the runtime for what the model cannot do (names the key)."""


@dataclass(frozen=True)
class RuntimeOptions:
    """What the runtime applies after the plan (each only when asked); ``where`` names the
    recipe in errors. ``mp_policy``: FSDP2's ``MixedPrecisionPolicy`` or None."""

    activation_checkpointing: bool = False
    compile: bool = False
    mp_policy: Any = None
    where: str = "the model"

    @classmethod
    def of(cls, config: TrainerConfig) -> "RuntimeOptions":
        """The recipe's options: ``training.activation_checkpointing``, ``training.compile``
        and its precision's FSDP2 policy."""
        return cls(config.training.activation_checkpointing, config.training.compile, fsdp_mixed_precision(config),
                   str(config.where))


def fsdp_mixed_precision(config: TrainerConfig) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for the recipe's precision (config/precision.py):
    all-gathered parameters cast to the compute dtype, gradients reduced in the reduce
    dtype into the float32 shards; None when nothing differs from the parameters' dtype
    (the plain float32 path stays bit for bit what it was)."""
    policy = precision_policy(config)
    if not policy.mixed:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=getattr(torch, policy.compute), reduce_dtype=getattr(torch, policy.reduce))


def apply_runtime(model: nn.Module, mesh_context: MeshContext | None, options: RuntimeOptions) -> nn.Module:
    """Activation checkpointing, compile (before FSDP2 wraps the layers: torchtitan's order)
    and FSDP2 over dp when the mesh has dp > 1, on ``model`` already planned."""
    if options.activation_checkpointing:
        if not hasattr(model, "gradient_checkpointing_enable"):
            raise AssemblyError(f"{options.where}: training.activation_checkpointing: {type(model).__name__} does "
                                f"not support gradient checkpointing")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if options.compile:
        compile_decoder_layers(model)
    if mesh_context is not None and mesh_context.dims.dp > 1:
        from hyper_parallel.distributed.fsdp import fully_shard_over_dp

        expert_mesh = mesh_context.expert_mesh
        # FSDP2 builds sub-meshes from rank tables, host data that a fake dry run keeps real;
        # fake parameters (dry-run --fake-tensors) still shard under their own mode.
        with outside_fake_tensors():
            fully_shard_over_dp(model, mesh_context.device_mesh["dp"],
                                expert_dp_mesh=expert_mesh["edp"] if expert_mesh is not None else None,
                                mp_policy=options.mp_policy)
    return model
