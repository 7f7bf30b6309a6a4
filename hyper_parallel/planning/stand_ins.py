"""Which traced module stands for a module of the planned model.

The dataflow is traced on a tiny copy of the model (its first layers, holding every layer
kind, and maybe fewer experts); the planner plans the full model. Names connect the two:
a module name with its indices written ``*`` (``pattern``) names every layer's (and
expert's) copy of one module, and ``StandIns`` finds, for each planned name, the traced
names that stand for it.
"""

from collections.abc import Iterable


def pattern(name: str) -> str:
    """A module name with every index written ``*`` (layer and expert numbers)."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


class StandIns:
    """Which traced module(s) stand for each of the planned model's modules. The traced
    copy has the model's first layers (every layer kind) and maybe fewer experts: a name
    stands for itself if traced, else for the traced names equal to it but for the layer
    index (its first number), else for those equal but for every number (an expert beyond
    the copy's count). A Sequential's children (``ffn.0``, ``ffn.2``) stay apart."""

    def __init__(self, traced: Iterable[str]):
        self.exact = set(traced)
        self.by_layer: dict[str, list[str]] = {}
        self.by_all: dict[str, list[str]] = {}
        for name in sorted(self.exact):
            self.by_layer.setdefault(_layer_pattern(name), []).append(name)
            self.by_all.setdefault(pattern(name), []).append(name)

    def __call__(self, name: str) -> list[str]:
        if name in self.exact:
            return [name]
        return self.by_layer.get(_layer_pattern(name)) or self.by_all.get(pattern(name), [])


def _layer_pattern(name: str) -> str:
    """A module name with its first index (the layer number) written ``*``."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:index] + ["*"] + parts[index + 1:])
    return name
