"""Placement text (``placement_text``) <-> ``torch.distributed.tensor`` placements.

A protocol module, not a distributed one: ``ShardingConfig`` holds these placements and
its dict form (``config_dict``) writes them as text, so both the protocols and the
distributed layer need the conversion, and it must sit below both.

``packed_shard(N,K)`` maps to ``_StridedShard(N, split_factor=K)``: DTensor's own
description of "K equal blocks along N, each chunked over the mesh axis".
"""

import functools
from collections.abc import Mapping

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from hyper_parallel.protocols.placement_text import (
    PlacementSpec,
    PlacementTextError,
    normalize_named_placement,
    parse_placement_text,
)


@functools.cache
def placement_from_text(text: str) -> Placement:
    """The torch placement of a placement's text. Cached: the applier's hooks turn a
    plan's texts into placements on every forward and backward, and a plan has a handful
    of distinct texts (torch placements are immutable, so one object serves every caller)."""
    return placement_from_spec(parse_placement_text(text))


def placement_from_spec(spec: PlacementSpec) -> Placement:
    """The torch placement of a parsed one (a recipe's, already checked when it loaded)."""
    if spec.kind == "replicate":
        return Replicate()
    if spec.kind == "partial":
        return Partial()
    if spec.kind == "shard":
        return Shard(spec.dim)
    return _StridedShard(spec.dim, split_factor=spec.packs)


def placement_to_text(placement: Placement | str) -> str:
    """Canonical text of a torch placement (text passes through, normalised)."""
    if isinstance(placement, str):
        return parse_placement_text(placement).text()
    if isinstance(placement, _StridedShard):  # before Shard: it may subclass Shard
        return f"packed_shard({placement.dim},{placement.split_factor})"
    if isinstance(placement, Shard):
        return f"shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "replicate"
    if isinstance(placement, Partial):
        if placement.reduce_op != "sum":
            raise PlacementTextError(
                f"only sum-partial placements have a text form, got Partial({placement.reduce_op!r})")
        return "partial"
    raise PlacementTextError(f"no text form for placement {placement!r}")


def as_placement(value: Placement | str) -> Placement:
    return placement_from_text(value) if isinstance(value, str) else value


def named_placement_to_text(named: Mapping) -> dict[str, str]:
    """``{axis: Placement | text}`` -> canonical ``{axis: text}`` in mesh axis order."""
    return normalize_named_placement({str(axis): placement_to_text(p) for axis, p in named.items()})


def named_placement_from_text(named: Mapping) -> dict[str, Placement]:
    return {axis: placement_from_text(text) for axis, text in named_placement_to_text(named).items()}
