"""A plan of one layer per kind, written out for every layer (``layer_kinds.py``).

The planner plans the view of the model that holds one layer of each kind
(``LayerKinds.view``); ``expanded`` writes what it placed as planning every layer would
have: each representative's entries and roles copied to every layer of its kind, under
that layer's names, in the order planning every layer places them. That order is the
generated file's order, so it is kept exactly: planning places modules in passes (the
roles pass in model order, one pass per layer part left whole, the sequence layout, the
expert layout), each going through the layers in order; a pass's layer entries come
layer by layer, those before and after the layers where they stand. The sequence
layout's pass is the one that goes through the layers more than once: first the layer
entries themselves (the first layer's sequence split, the layers' other inputs), then
their blocks, then what follows the layers (``layers_first``).
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from hyper_parallel.planning.layer_kinds import LayerKinds
from hyper_parallel.protocols.sharding import IO_PLACEMENT_FIELDS, ShardingConfig


@dataclass(frozen=True)
class PlacingPass:
    """The modules one pass of the planner placed first, in the order it placed them."""

    keys: tuple[str, ...]
    layers_first: bool = False  # the layer entries of all layers, then their blocks (the sequence layout)


@dataclass
class PlacedModules:
    """The planner's entries and roles before the recipe's overrides, with the passes that
    placed them and what the notes are made of (attention blocks gathered over cp with
    why, the hand-off check's refusals, the notes of the layer parts left whole)."""

    modules: dict[str, ShardingConfig] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    passes: list[PlacingPass] = field(default_factory=list)
    gathered: dict[str, str] = field(default_factory=dict)
    handoff_refusals: dict[str, str] = field(default_factory=dict)
    whole_notes: list[str] = field(default_factory=list)

    def place(self, fqn: str, role: str, config: ShardingConfig) -> None:
        """``fqn`` gets ``role`` and ``config``."""
        self.roles[fqn], self.modules[fqn] = role, config

    @contextlib.contextmanager
    def placing_pass(self, *, layers_first: bool = False) -> Iterator[None]:
        """Record the modules the enclosed code places first as one pass."""
        before = set(self.modules)
        yield
        self.passes.append(PlacingPass(tuple(key for key in self.modules if key not in before), layers_first))


def expanded(placed: PlacedModules, kinds: LayerKinds) -> PlacedModules:
    """``placed`` (planned on ``kinds.view``) for every layer (module docstring)."""
    out = PlacedModules(whole_notes=list(placed.whole_notes))
    for placing in placed.passes:
        for key, index in _in_pass_order(placing, kinds):
            if key in placed.modules:
                out.modules[kinds.renamed(key, index) if index is not None else key] = _copied(placed.modules[key])
    for key, role in placed.roles.items():
        for name, _ in _for_every_layer(key, kinds):
            out.roles[name] = role
    for key, why in placed.gathered.items():
        for name, index in _for_every_layer(key, kinds):
            out.gathered[name] = why if index is None else kinds.renamed_in_text(why, kinds.layer_of(key), index)
    for key, why in placed.handoff_refusals.items():
        out.handoff_refusals.update((name, why) for name, _ in _for_every_layer(key, kinds))
    return out


def _in_pass_order(placing: PlacingPass, kinds: LayerKinds) -> list[tuple[str, int | None]]:
    """(representative's key, layer index or None) in the order planning every layer
    places them in this pass: what stands before the layers, the layers' entries layer by
    layer (with ``layers_first``, first the layer entries themselves of every layer, then
    those inside them), then what stands after."""
    before: list[str] = []
    after: list[str] = []
    own: dict[int, list[str]] = {}  # representative -> its layer's own entry (layers_first)
    inside: dict[int, list[str]] = {}  # representative -> its entries, in order
    for key in placing.keys:
        layer = kinds.layer_of(key)
        if layer is None:
            (after if inside or own else before).append(key)
        elif placing.layers_first and key == f"{kinds.layers_fqn}.{layer}":
            own.setdefault(layer, []).append(key)
        else:
            inside.setdefault(layer, []).append(key)
    layered = [(key, index) for group in (own, inside) for index, kind in enumerate(kinds.kind_of)
               for key in group.get(kind, ())]
    return [(key, None) for key in before] + layered + [(key, None) for key in after]


def _for_every_layer(key: str, kinds: LayerKinds) -> list[tuple[str, int | None]]:
    """(name, layer index) of ``key`` in every layer of its kind; itself outside the layers."""
    layer = kinds.layer_of(key)
    if layer is None:
        return [(key, None)]
    return [(kinds.renamed(key, index), index) for index in kinds.members[layer]]


def _copied(config: ShardingConfig) -> ShardingConfig:
    """An entry of its own for another layer: its dicts and tuples copied, the placements
    (immutable) shared."""
    io = {key: _copied_io(getattr(config, key)) for key in IO_PLACEMENT_FIELDS}
    return ShardingConfig(state_shardings={name: dict(named) for name, named in config.state_shardings.items()},
                          local_map=config.local_map, local_sizes=config.local_sizes,
                          local_slices=dict(config.local_slices), state_handoff=config.state_handoff, **io)


def _copied_io(value):
    """An IO placement (one dict, a tuple of dicts and Nones, or None) copied."""
    if value is None or isinstance(value, dict):
        return None if value is None else dict(value)
    return tuple(None if named is None else dict(named) for named in value)
