"""Parallel sizes and the device mesh they describe.

``mesh_layout`` is the one place that decides the mesh axis names, their order and
their sizes; the offline mesh (``planning/offline_mesh.py``: planning, codegen) and the
real ``DeviceMesh`` (training, preflight) are both built from it, so they cannot disagree.

The sizes themselves (``ParallelDims``, validated where they are made) live with the
recipe in ``config.parallel_dims``; expert parallelism borrows its ranks from ``dp * cp``.
"""

import os
from dataclasses import dataclass
from typing import Any

from hyper_parallel.config.layout import Layout
from hyper_parallel.config.parallel_dims import ParallelDims
from hyper_parallel.protocols.axes import CP, DP, EXPERT_MESH_AXES, MESH_AXES, PP, TP

# Mesh axis order, outermost first (protocols/axes.py says why this order).
MESH_AXIS_ORDER = MESH_AXES


def mesh_layout(dims: ParallelDims) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Mesh axis names and sizes, outermost first; every axis is present, even of size 1."""
    return MESH_AXIS_ORDER, tuple(getattr(dims, axis) for axis in MESH_AXIS_ORDER)


# The expert view of the same ranks: dp*cp (adjacent in MESH_AXIS_ORDER, so contiguous in
# row-major rank order) regrouped as (edp, ep), ep innermost: ep ranks are neighbours.
EXPERT_MESH_AXIS_ORDER = EXPERT_MESH_AXES


def expert_mesh_layout(dims: ParallelDims) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The expert mesh: the rank grid of ``mesh_layout`` with dp*cp reshaped to edp*ep."""
    names, sizes = mesh_layout(dims)
    by_axis = dict(zip(names, sizes))
    borrowed = by_axis[DP] * by_axis[CP]
    return EXPERT_MESH_AXIS_ORDER, (by_axis[PP], borrowed // dims.ep, dims.ep, by_axis[TP])


def build_device_mesh(dims: ParallelDims, device_type: str = "cpu") -> Any:
    """A real ``DeviceMesh`` over all ranks, initialising the process group if needed: gloo
    on the CPU, else one backend per device type (``platform.device.RunDevice.backend``:
    gloo for host objects beside nccl or hccl) with this rank's device made current."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel.platform.device import BACKENDS, RunDevice, device_module
    from hyper_parallel.platform.host_values import outside_fake_tensors

    if device_type not in BACKENDS:
        raise ValueError(f"device_type must be one of {sorted(BACKENDS)}, got {device_type!r}")
    run = RunDevice(device_type, None if device_type == "cpu" else int(os.environ.get("LOCAL_RANK", "0")))
    if device_type != "cpu":
        device_module(device_type)  # torch_npu registers the npu device and hccl on import
    names, sizes = mesh_layout(dims)
    if not dist.is_initialized():
        dist.init_process_group(backend=run.backend)
    world = dist.get_world_size()
    if world != dims.world_size:
        raise ValueError(
            f"WORLD_SIZE is {world} but the parallel sizes give pp*dp*cp*tp="
            f"{dims.pp}*{dims.dp}*{dims.cp}*{dims.tp}={dims.world_size}")
    run.select()
    with outside_fake_tensors():  # a mesh's rank table is host data, real under a fake dry run too
        return init_device_mesh(device_type, sizes, mesh_dim_names=names)


def build_expert_mesh(dims: ParallelDims, device_type: str = "cpu") -> Any:
    """The expert ``DeviceMesh`` (``expert_mesh_layout``) over the same, initialised, ranks."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from hyper_parallel.platform.host_values import outside_fake_tensors

    names, sizes = expert_mesh_layout(dims)
    with outside_fake_tensors():  # host data, as build_device_mesh's
        return DeviceMesh(device_type, torch.arange(dims.world_size).reshape(sizes), mesh_dim_names=names)


@dataclass
class MeshContext:
    """What a generated ``hyper_parallelize(model, mesh_context)`` receives: the device mesh
    and the run's whole ``Layout`` (the recipe's, ``AcceleratorConfig.layout``), which the
    runtime compares with the layout the plan was made for."""

    device_mesh: Any
    layout: Layout
    expert_mesh: Any = None  # built on first use by the applier when a plan shards on ep

    def __post_init__(self) -> None:
        if not isinstance(self.layout, Layout):
            raise TypeError(f"MeshContext.layout: expected a Layout (config.layout; a recipe's is "
                            f"config.accelerator.layout), got {type(self.layout).__name__}")

    @property
    def dims(self) -> ParallelDims:
        return self.layout.dims
