import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.distributed.applier import local_piece
from hyper_parallel.protocols.placement_text import PlacementTextError, local_shard_shape
from hyper_parallel.protocols.placements import (
    named_placement_from_text,
    named_placement_to_text,
    placement_from_text,
    placement_to_text,
)


@pytest.mark.parametrize("text, placement", [
    ("replicate", Replicate()),
    ("partial", Partial()),
    ("shard(1)", Shard(1)),
    ("packed_shard(1,2)", _StridedShard(1, split_factor=2)),
])
def test_text_and_torch_placements_round_trip(text, placement):
    assert placement_from_text(text) == placement
    assert placement_to_text(placement) == text


def test_text_is_normalised_and_bad_text_is_named():
    assert placement_to_text(" Shard( 0 ) ") == "shard(0)"
    with pytest.raises(PlacementTextError, match="unknown placement 'colwise'"):
        placement_from_text("colwise")
    with pytest.raises(PlacementTextError, match="only sum-partial"):
        placement_to_text(Partial("max"))


def test_named_placements_over_mesh_axes():
    assert named_placement_from_text({"tp": "partial"}) == {"tp": Partial()}
    assert named_placement_to_text({"tp": Shard(2), "dp": Replicate()}) == {"dp": "replicate", "tp": "shard(2)"}


def test_packed_shard_slices_every_block():
    # the HF gate_up layout: [gate | up]; each rank keeps its half of both
    full = torch.arange(8)
    packed = _StridedShard(0, split_factor=2)
    assert local_piece(full, packed, 2, 0).tolist() == [0, 1, 4, 5]
    assert local_piece(full, packed, 2, 1).tolist() == [2, 3, 6, 7]
    assert local_piece(full, Shard(0), 2, 1).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("shape, named, coords, expected", [
    ((4, 64, 64), {"tp": "packed_shard(1,2)"}, (0, 0, 1, 1), (4, 32, 64)),
    ((4, 64, 32), {"tp": "shard(2)"}, (0, 0, 0, 1), (4, 64, 16)),
    ((64,), {"tp": "replicate"}, (0, 0, 1, 1), (64,)),
    ((2, 3, 8), {"tp": "shard(-1)"}, (0, 0, 0, 0), (2, 3, 4)),
    ((8, 8), {"cp": "shard(0)", "tp": "shard(0)"}, (0, 0, 1, 1), (2, 8)),
])
def test_local_shard_shape_follows_dtensor(shape, named, coords, expected):
    assert local_shard_shape(shape, named, ("pp", "dp", "cp", "tp"), (1, 1, 2, 2), coords) == expected


def test_local_shard_shape_uneven_chunks_like_torch_chunk():
    sizes = [local_shard_shape((5,), {"tp": "shard(0)"}, ("tp",), (4,), (c,))[0] for c in range(4)]
    assert sizes == [len(piece) for piece in torch.arange(5).chunk(4)] + [0]


def test_local_shard_shape_errors_name_the_problem():
    with pytest.raises(PlacementTextError, match=r"names axes \['ep'\] that are not in mesh"):
        local_shard_shape((4,), {"ep": "shard(0)"}, ("tp",), (2,), (0,))
    with pytest.raises(PlacementTextError, match="dim 0 of size 5 is not divisible by 2"):
        local_shard_shape((5,), {"tp": "packed_shard(0,2)"}, ("tp",), (2,), (0,))
