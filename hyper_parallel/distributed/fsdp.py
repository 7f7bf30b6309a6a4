"""Data parallel with FSDP2, as the trainer applies it on top of the plan."""

from torch import nn

from hyper_parallel.distributed.pipeline import STAGE_ATTRIBUTE


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 wraps one by one: HF's ``_no_split_modules`` classes."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def units_of_their_own(layers: list[nn.Module]) -> list[nn.Module]:
    """The layers that share no parameter with another layer. A block shared by several
    layers (Zamba's shared transformer, reached from each hybrid layer) cannot be in two
    FSDP2 units; those layers are left to the root unit, which gathers them with the rest."""
    seen: dict[int, int] = {}
    for layer in layers:
        for param in layer.parameters():
            seen[id(param)] = seen.get(id(param), 0) + 1
    return [layer for layer in layers if all(seen[id(param)] == 1 for param in layer.parameters())]


def expert_parallel_modules(layer: nn.Module) -> list[nn.Module]:
    """Modules whose own parameters the plan placed on the expert mesh (an ``ep`` axis)."""
    found = []
    for module in layer.modules():
        meshes = [getattr(param, "device_mesh", None) for param in module.parameters(recurse=False)]
        if any(mesh is not None and "ep" in (mesh.mesh_dim_names or ()) for mesh in meshes):
            found.append(module)
    return found


def fully_shard_over_dp(model: nn.Module, dp_mesh, expert_dp_mesh=None, mp_policy=None) -> nn.Module:
    """FSDP2 ``fully_shard`` over the dp mesh: each decoder layer, then the root.

    Gradients are averaged over dp, so with equal-sized per-rank batches the result is
    the gradient of the global-batch mean loss. Expert-parallel modules are sharded on
    their own over ``expert_dp_mesh`` (the expert mesh's ``edp`` axis: the dp*cp ranks
    that hold the same experts), since their ranks may overlap the dp mesh's. Their
    gradients already sum the tokens of every rank of their ep group, so the reduction
    over edp divides by dp, as for every other parameter. ``mp_policy`` (FSDP2's
    ``MixedPrecisionPolicy``, None: compute in the parameters' dtype) applies to every
    group alike."""
    from torch.distributed.fsdp import fully_shard

    options = {} if mp_policy is None else {"mp_policy": mp_policy}

    dp_size = dp_mesh.size()
    for layer in units_of_their_own(decoder_layers(model)):
        for experts in expert_parallel_modules(layer):
            if expert_dp_mesh is None:
                raise ValueError(f"{type(experts).__name__} is expert parallel; fully_shard_over_dp needs the "
                                 "expert mesh's edp axis (expert_dp_mesh)")
            fully_shard(experts, mesh=expert_dp_mesh, **options).set_gradient_divide_factor(float(dp_size))
        fully_shard(layer, mesh=dp_mesh, **options)
    base, stage = getattr(model, "base_model", None), model.__dict__.get(STAGE_ATTRIBUTE)
    before_last = stage is not None and any(index < stage.num_stages - 1 for index in stage.stages)
    if before_last and isinstance(base, nn.Module) and base is not model:
        # A pipeline stage before the last runs the base model, not the head model's
        # forward (distributed/pipeline.py): the base model is then the unit FSDP2
        # gathers and reduces from, so it is one of its own.
        fully_shard(base, mesh=dp_mesh, **options)
    fully_shard(model, mesh=dp_mesh, **options)
    if stage is not None:
        # FSDP2 makes the first unit to run forward the root; a stage before the last runs
        # the base model first, and a rank that also runs the last stage (interleaved)
        # then calls the whole model, which would find its units claimed. The model is the
        # root from the start.
        model._get_fsdp_state()._lazy_init()
    return model
