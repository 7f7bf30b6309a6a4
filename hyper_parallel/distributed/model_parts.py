"""Named parts of a model the planner and the applier both look for."""

import inspect

from torch import nn


def positional_names(module: nn.Module) -> list[str]:
    """``module.forward``'s positional parameter names in order: a planned positional
    input passed by keyword is found by its name."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def locate_input(index: int, args: list, kwargs: dict, names: list[str]):
    """Where input ``index`` of a call is: ``(args, index)``, ``(kwargs, name)`` when it was
    passed by keyword (``names``: ``positional_names``), or ``(None, None)`` when absent."""
    if index < len(args):
        return args, index
    if index < len(names) and names[index] in kwargs:
        return kwargs, names[index]
    return None, None


def input_embeddings(model: nn.Module) -> nn.Module | None:
    return _part(model, "get_input_embeddings")


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """The lm_head of a causal LM (None for models without one)."""
    return _part(model, "get_output_embeddings")


class LayerSubset(nn.ModuleList):
    """Some of a model's decoder layers, each under its own index (``layers.0``,
    ``layers.7``): a view of the model in which the planner sees one layer of each kind
    (``planning/layer_kinds.py``) by the names the whole model gives it. Indexed by those
    indices; iterated in their order."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    def __getitem__(self, index: int) -> nn.Module:
        return self._modules[str(index)]


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """(name, list) of the decoder layers: a ``LayerSubset`` where the model is a view of
    some of its layers; else among the ``nn.ModuleList``s not nested in another list (an
    MoE's experts and a layer's own lists of norms are), the shallowest with
    ``num_hidden_layers`` entries, else the longest; None without a list. The probe and
    the sequence layout both use this one rule."""
    lists = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    subset = [item for item in lists if isinstance(item[1], LayerSubset)]
    if subset:
        return subset[0]
    outer = [item for item in lists if not any(item[0].startswith(other + ".") for other, _ in lists)]
    if not outer:
        return None
    depth = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    exact = [item for item in outer if len(item[1]) == depth]
    if exact:
        return min(exact, key=lambda item: (item[0].count("."), item[0]))
    return max(outer, key=lambda item: len(item[1]))


def _part(model: nn.Module, getter_name: str) -> nn.Module | None:
    getter = getattr(model, getter_name, None)
    try:
        return getter() if getter else None
    except (NotImplementedError, AttributeError):  # HF base classes raise for "not this model"
        return None
