"""Named parts of a model the planner and the applier both look for."""

from torch import nn


def input_embeddings(model: nn.Module) -> nn.Module | None:
    return _part(model, "get_input_embeddings")


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """The lm_head of a causal LM (None for models without one)."""
    return _part(model, "get_output_embeddings")


def _part(model: nn.Module, getter_name: str) -> nn.Module | None:
    getter = getattr(model, getter_name, None)
    try:
        return getter() if getter else None
    except (NotImplementedError, AttributeError):  # HF base classes raise for "not this model"
        return None
