"""The recorded weight map, derived on one layer of each kind (``layer_kinds.py``).

Deriving the weight map (``distributed/weight_map.py``) runs transformers' key loop over
every checkpoint tensor: 36,000 of them for a 94-layer model of 128 experts, the same few
rules for each layer. Here it runs on the view of the model holding one layer of each
kind, and ``to_text`` writes the recorded text as it does for every layer, each key
standing for its copies in the other layers of its kind. That needs each rule of a layer
to be its key's indices in a template (``rule_template``); where one is not (a rule naming
another layer's tensor), or a key holds a ``*`` of its own, every layer is derived as
before.
"""

from torch import nn

from hyper_parallel.distributed.checkpoint_names import model_tensor_names
from hyper_parallel.distributed.weight_map import (
    Rule,
    derive_weight_map,
    rule_template,
    saved_layout,
    to_text,
    weight_map_text,
)
from hyper_parallel.planning.layer_kinds import LayerKinds, planning_kinds


def weight_map_by_kind(model: nn.Module, hf_model: nn.Module | None = None) -> dict[str, str | list[str]]:
    """``weight_map_text`` of ``model`` (from ``hf_model``'s saved layout, the model before
    its replacements, where given), derived on one layer of each kind where the layers
    fall into fewer kinds than there are layers."""
    kinds = _joint_kinds(model, hf_model)
    if kinds is not None and kinds.reduces:
        view = kinds.view(model)
        hf_view = kinds.view(hf_model) if hf_model is not None else None
        names = model_tensor_names(hf_view) if hf_view is not None else None
        rules = derive_weight_map(view, saved_layout(hf_view if hf_view is not None else view),
                                  names_before_replacement=names)
        if _alike_in_every_layer(rules, kinds):
            return to_text(rules, stands_for=_LayerCopies(kinds))
    if hf_model is None:
        return weight_map_text(model)
    return weight_map_text(model, hf_model=hf_model, names_before_replacement=model_tensor_names(hf_model))


def _joint_kinds(model: nn.Module, hf_model: nn.Module | None) -> LayerKinds | None:
    """The layer kinds of ``model`` and, where given, of ``hf_model`` at once: two layers are
    one kind where they are in both models."""
    kinds = planning_kinds(model)
    if kinds is None or hf_model is None:
        return kinds
    before = planning_kinds(hf_model)
    if before is None or before.layers_fqn != kinds.layers_fqn or len(before.kind_of) != len(kinds.kind_of):
        return None
    first: dict[tuple[int, int], int] = {}
    joint = tuple(first.setdefault(pair, index) for index, pair in enumerate(zip(kinds.kind_of, before.kind_of)))
    return LayerKinds(kinds.layers_fqn, joint)


def _alike_in_every_layer(rules: dict[str, list[Rule]], kinds: LayerKinds) -> bool:
    """Every rule of a layer's key is a template of the key's indices (so the layer's
    copies have the same rules by their indices), and no key holds a ``*`` of its own."""
    return not any("*" in key for key in rules) and all(
        rule_template(key, rule.text()) is not None for key, found in rules.items()
        if kinds.layer_of(key) is not None for rule in found)


class _LayerCopies:
    """A key of the view as its copies in every layer of its kind (``KeyCopies``)."""

    def __init__(self, kinds: LayerKinds):
        self.kinds = kinds

    def count(self, key: str) -> int:
        """How many keys ``key`` stands for: one per layer of its kind (1 outside the layers)."""
        layer = self.kinds.layer_of(key)
        return 1 if layer is None else len(self.kinds.members[layer])

    def names(self, key: str) -> list[str]:
        """``key`` in every layer of its kind (itself outside the layers)."""
        layer = self.kinds.layer_of(key)
        return [key] if layer is None else [self.kinds.renamed(key, index) for index in self.kinds.members[layer]]
