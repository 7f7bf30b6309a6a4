"""Placements as text: the one spelling used in recipes, plan JSON and generated files.

Grammar (per mesh axis)::

    replicate | partial | shard(N) | packed_shard(N,K)

``packed_shard(N,K)`` is a tensor that packs K equal blocks along dim N (HF's fused
``gate_up_proj``); each rank keeps its slice of every block, so that ``chunk(K, N)``
on the local tensor still yields matching pieces. It maps to DTensor's
``_StridedShard(N, split_factor=K)``.

A *named placement* maps mesh axis names to such strings, e.g. ``{"tp": "shard(0)"}``;
an axis that is not named is replicated. This module imports no torch so that the
freeze stage and up-to-date checks stay cheap. It is part of the protocol layer (the
plan's wire format), so that codegen, the distributed layer and ``config_dict`` all
read it from below.
"""

import re
from dataclasses import dataclass

from hyper_parallel.errors import HyperParallelError
from hyper_parallel.protocols.axes import PLACEMENT_AXES as MESH_AXES

_SHARD = re.compile(r"^shard\(\s*(-?\d+)\s*\)$")
_PACKED = re.compile(r"^packed_shard\(\s*(-?\d+)\s*,\s*(\d+)\s*\)$")


class PlacementTextError(ValueError, HyperParallelError):
    """A placement string or named placement that does not parse."""


@dataclass(frozen=True, slots=True)
class PlacementSpec:
    kind: str  # "replicate" | "partial" | "shard" | "packed_shard"
    dim: int | None = None
    packs: int | None = None

    def text(self) -> str:
        if self.kind == "shard":
            return f"shard({self.dim})"
        if self.kind == "packed_shard":
            return f"packed_shard({self.dim},{self.packs})"
        return self.kind


def parse_placement_text(text: object) -> PlacementSpec:
    if not isinstance(text, str):
        raise PlacementTextError(
            f"placement must be a string (replicate | partial | shard(N)), got {text!r}")
    value = text.strip().lower()
    if value in ("replicate", "partial"):
        return PlacementSpec(value)
    if m := _SHARD.match(value):
        return PlacementSpec("shard", int(m.group(1)))
    if m := _PACKED.match(value):
        packs = int(m.group(2))
        if packs < 1:
            raise PlacementTextError(f"packed_shard needs K >= 1, got {text!r}")
        return PlacementSpec("packed_shard", int(m.group(1)), packs)
    raise PlacementTextError(
        f"unknown placement {text!r}; expected replicate | partial | shard(N) | packed_shard(N,K)")


def normalize_named_placement(named: object, *, where: str = "placement") -> dict[str, str]:
    """Validate ``{axis: text}`` and return it in canonical spelling with axes in mesh
    order. Explicit ``replicate`` entries are kept: they make the plan readable."""
    if not isinstance(named, dict):
        raise PlacementTextError(
            f"{where}: expected a mapping of mesh axis to placement, got {type(named).__name__} {named!r}")
    out: dict[str, str] = {}
    for axis in sorted(named, key=_axis_order):
        if axis not in MESH_AXES:
            raise PlacementTextError(
                f"{where}: unknown mesh axis {axis!r}; expected one of {', '.join(MESH_AXES)}")
        try:
            out[axis] = parse_placement_text(named[axis]).text()
        except PlacementTextError as exc:
            raise PlacementTextError(f"{where}.{axis}: {exc}") from None
    return out


def normalize_io_placements(value: object, *, where: str) -> list[dict[str, str] | None] | None:
    """An ``in_src``/``in_dst``/``out_src``/``out_dst`` value in canonical form: one named
    placement per positional input/output (a single mapping means the first), None kept."""
    if value is None:
        return None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise PlacementTextError(f"{where}: expected a mapping or a list of mappings, got {value!r}")
    return [None if v is None else normalize_named_placement(v, where=f"{where}[{i}]") for i, v in enumerate(value)]


def _axis_order(axis: str) -> int:
    return MESH_AXES.index(axis) if axis in MESH_AXES else len(MESH_AXES)


def local_shard_shape(global_shape, named_placement_text, mesh_axes, mesh_sizes, coords) -> tuple[int, ...]:
    """Shape of the local shard a rank at mesh ``coords`` holds (DTensor semantics).

    Mesh axes apply in mesh order, each splitting what the previous ones left, as
    ``torch.chunk`` does: ceil-sized pieces, trailing ranks possibly short or empty.
    ``packed_shard(N,K)`` splits each of the K blocks along N and keeps one piece of each.
    """
    if not (len(mesh_axes) == len(mesh_sizes) == len(coords)):
        raise PlacementTextError(
            f"mesh_axes {list(mesh_axes)}, mesh_sizes {list(mesh_sizes)} and coords {list(coords)} "
            "must have the same length")
    named = normalize_named_placement(named_placement_text)
    missing = sorted(set(named) - set(mesh_axes))
    if missing:
        raise PlacementTextError(f"placement {named} names axes {missing} that are not in mesh {list(mesh_axes)}")
    shape = list(global_shape)
    for axis, size, coord in zip(mesh_axes, mesh_sizes, coords):
        spec = parse_placement_text(named.get(axis, "replicate"))
        if spec.kind not in ("shard", "packed_shard"):
            continue
        dim = spec.dim + len(shape) if spec.dim < 0 else spec.dim
        if not 0 <= dim < len(shape):
            raise PlacementTextError(f"{spec.text()} on axis {axis!r} is out of range for shape {tuple(global_shape)}")
        if spec.kind == "shard":
            shape[dim] = _chunk_length(shape[dim], size, coord)
        else:
            if shape[dim] % spec.packs:
                raise PlacementTextError(
                    f"{spec.text()} on axis {axis!r}: dim {dim} of size {shape[dim]} is not divisible by {spec.packs}")
            shape[dim] = spec.packs * _chunk_length(shape[dim] // spec.packs, size, coord)
    return tuple(shape)


def _chunk_length(length: int, pieces: int, index: int) -> int:
    step = -(-length // pieces)  # ceil, as torch.chunk
    return max(0, min(step, length - index * step))
