import re

import pytest

from hyper_parallel.config.layout import Layout
from hyper_parallel.config.parallel_dims import ParallelDimsError
from hyper_parallel.distributed.mesh import MeshContext, ParallelDims, build_device_mesh, mesh_layout
from hyper_parallel.planning.offline_mesh import OfflineMesh, build_offline_mesh


def test_world_size_excludes_ep_and_accepts_borrowed_ep():
    dims = ParallelDims(dp=1, cp=2, tp=2, ep=2)
    assert dims.world_size == 4


@pytest.mark.parametrize("sizes, message", [
    ({"dp": 2, "cp": 1, "ep": 4}, "accelerator.ep_size: expected a divisor of dp_size*cp_size = 2, got 4"),
    ({"tp": 0}, "accelerator.tp_size: expected an integer >= 1, got 0"),
    ({"pp": 1.5}, "accelerator.pp_size: expected an integer >= 1, got 1.5"),
    ({"dp": True}, "accelerator.dp_size: expected an integer >= 1, got True"),
])
def test_parallel_dims_refuse_bad_sizes_when_made(sizes, message):
    """Self-validating: an invalid ParallelDims never exists, so nothing downstream re-checks."""
    with pytest.raises(ParallelDimsError, match=re.escape(message)) as caught:
        ParallelDims(**sizes)
    assert caught.value.key == message.split(":")[0]


def test_mesh_layout_has_all_axes_in_fixed_order():
    assert mesh_layout(ParallelDims(tp=2, cp=2)) == (("pp", "dp", "cp", "tp"), (1, 1, 2, 2))


def test_offline_mesh_sizes_and_row_major_coordinates():
    mesh = build_offline_mesh(ParallelDims(dp=2, tp=2))
    assert mesh == OfflineMesh(("pp", "dp", "cp", "tp"), (1, 2, 1, 2))
    assert mesh.size("tp") == 2 and mesh.world_size == 4
    assert [mesh.coordinates(r) for r in range(4)] == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (0, 1, 0, 1)]
    assert mesh.size("ep") == 1 and "ep" not in mesh.axis_names  # ep lives on the expert mesh
    with pytest.raises(KeyError, match="no axis 'edp'"):
        mesh.size("edp")


def test_active_axes_spell_when_values():
    assert ParallelDims(tp=2, cp=2, ep=2).active_axes(sequence_parallel=True) == {"tp", "cp", "ep", "sp"}


def test_build_device_mesh_checks_world_size_then_builds_named_mesh(world_one_group):
    with pytest.raises(ValueError, match=r"WORLD_SIZE is 1 but .*=2"):
        build_device_mesh(ParallelDims(tp=2), "cpu")
    mesh = build_device_mesh(ParallelDims(), "cpu")
    assert mesh.mesh_dim_names == ("pp", "dp", "cp", "tp")
    assert tuple(mesh.shape) == (1, 1, 1, 1)
    assert MeshContext(mesh, Layout(ParallelDims())).device_mesh is mesh


def test_build_device_mesh_rejects_unknown_device_type():
    with pytest.raises(ValueError, match="device_type must be one of"):
        build_device_mesh(ParallelDims(), "tpu")
