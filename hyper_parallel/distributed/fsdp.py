"""Data parallel with FSDP2, as the trainer applies it on top of the plan (DESIGN §5, §9)."""

from torch import nn


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 wraps one by one: HF's ``_no_split_modules`` classes."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def fully_shard_over_dp(model: nn.Module, dp_mesh) -> nn.Module:
    """FSDP2 ``fully_shard`` over the dp mesh: each decoder layer, then the root.

    Gradients are averaged over dp, so with equal-sized per-rank batches the result is
    the gradient of the global-batch mean loss."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model
