"""The mesh's shape without any process group: what planning and codegen reason over.

The planner lays a plan out over named axes and sizes, preflight computes each rank's
coordinates, verify rebuilds the layout of a job: none of them has (or may start) a
process group. ``build_offline_mesh`` takes the axis names, order and sizes from
``distributed.mesh.mesh_layout``, the one place the real ``DeviceMesh`` takes them from too.
"""

from dataclasses import dataclass

from hyper_parallel.config.parallel_dims import ParallelDims
from hyper_parallel.distributed.mesh import mesh_layout
from hyper_parallel.protocols.axes import EP


@dataclass(frozen=True)
class OfflineMesh:
    """The mesh's shape without any process group (module docstring)."""

    axis_names: tuple[str, ...]
    sizes: tuple[int, ...]
    ep: int = 1  # the expert axis lives on the expert mesh (ranks borrowed from dp*cp)

    @property
    def placement_axes(self) -> tuple[str, ...]:
        """Axes a placement may name: the mesh's, and ``ep``."""
        return (*self.axis_names, EP)

    def size(self, axis: str) -> int:
        if axis == EP:
            return self.ep
        if axis not in self.axis_names:
            raise KeyError(f"mesh has no axis {axis!r}; axes are {list(self.axis_names)}")
        return self.sizes[self.axis_names.index(axis)]

    @property
    def world_size(self) -> int:
        total = 1
        for size in self.sizes:
            total *= size
        return total

    def coordinates(self, rank: int) -> tuple[int, ...]:
        """Row-major coordinates of ``rank`` (the layout init_device_mesh uses)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of world size {self.world_size}")
        coords = []
        for size in reversed(self.sizes):
            coords.append(rank % size)
            rank //= size
        return tuple(reversed(coords))


def build_offline_mesh(dims: ParallelDims) -> OfflineMesh:
    names, sizes = mesh_layout(dims)
    return OfflineMesh(names, sizes, ep=dims.ep)
