import pytest

from hyper_parallel.distributed.mesh import (
    MeshContext,
    OfflineMesh,
    ParallelDims,
    build_device_mesh,
    build_offline_mesh,
    mesh_layout,
)


def test_world_size_excludes_ep_and_validate_accepts_borrowed_ep():
    dims = ParallelDims(dp=1, cp=2, tp=2, ep=2).validate()
    assert dims.world_size == 4


@pytest.mark.parametrize("dims, message", [
    (ParallelDims(dp=2, cp=1, ep=4), "ep_size=4 must divide dp_size*cp_size=2*1=2"),
    (ParallelDims(tp=0), "tp_size must be an integer >= 1, got 0"),
    (ParallelDims(pp=1.5), "pp_size must be an integer >= 1, got 1.5"),
])
def test_validate_names_the_bad_size(dims, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace(".", r"\.")):
        dims.validate()


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
    assert MeshContext(mesh, ParallelDims()).device_mesh is mesh


def test_build_device_mesh_rejects_unknown_device_type():
    with pytest.raises(ValueError, match="device_type must be one of"):
        build_device_mesh(ParallelDims(), "tpu")
