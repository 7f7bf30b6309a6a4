"""One rank's share of a module run on its heads (``local_views``): the packed blocks of
unequal sizes, the size attributes, and the errors that name what does not divide."""

import pytest
import torch
from torch import nn

from torch.distributed.tensor import Replicate, Shard

from hyper_parallel.distributed.local_views import (
    LocalViewError,
    PackedRows,
    block_sizes,
    local_sizes,
    owner_of,
    packed_blocks_piece,
)
from hyper_parallel.distributed.sharded_load import local_segments


class Mixer(nn.Module):
    """[q | k | v] channels of unequal widths, as Qwen3-Next's gated delta-net packs them."""

    def __init__(self):
        super().__init__()
        self.num_k_heads, self.num_v_heads, self.key_dim, self.value_dim = 2, 4, 4, 8
        self.conv1d = nn.Conv1d(16, 16, 3, groups=16, bias=False)


def test_each_rank_takes_its_piece_of_every_block():
    channels = torch.arange(16)
    sizes = block_sizes(Mixer(), ("key_dim", "key_dim", "value_dim"), "m")
    assert sizes == [4, 4, 8]
    assert packed_blocks_piece(channels, 0, sizes, 2, 0, "m").tolist() == [0, 1, 4, 5, 8, 9, 10, 11]
    assert packed_blocks_piece(channels, 0, sizes, 2, 1, "m").tolist() == [2, 3, 6, 7, 12, 13, 14, 15]
    # the pieces of all ranks are every channel once
    pieces = torch.cat([packed_blocks_piece(channels, 0, sizes, 4, r, "m") for r in range(4)])
    assert sorted(pieces.tolist()) == list(range(16))


@pytest.mark.parametrize("pieces", [1, 2, 4])
def test_packed_order_holds_each_ranks_piece_of_every_block_rank_after_rank(pieces):
    """A parameter stored ``Shard(0)`` in packed order: rank r's chunk of the stored tensor
    is its piece of every block, the order maps stored rows back to the model's, each
    block's rows sit where ``local_blocks`` says, and the checkpoint loader reads exactly
    those rows (``local_segments``, with a replicated mesh dim before tp's)."""
    model_rows = torch.arange(16) * 10
    rows = PackedRows(dim=0, sizes=(4, 4, 8), pieces=pieces, mesh_dim=1)
    stored = model_rows[rows.stored_rows()]
    assert sorted(stored.tolist()) == model_rows.tolist()
    for rank, local in enumerate(stored.chunk(pieces)):
        assert local.tolist() == packed_blocks_piece(model_rows, 0, [4, 4, 8], pieces, rank, "m").tolist()
        for (start, length), (lo, hi) in zip(rows.local_blocks(), rows.segments(rank)):
            assert local[start:start + length].tolist() == model_rows[lo:hi].tolist()
        segments = local_segments((16, 3), (Replicate(), Shard(0)), (0, rank), (2, pieces), rows)
        assert segments == [rows.segments(rank), [(0, 3)]]
        assert torch.cat([model_rows[lo:hi] for lo, hi in segments[0]]).tolist() == local.tolist()


def test_blocks_that_do_not_fit_or_divide_are_named():
    with pytest.raises(LocalViewError, match=r"m: packed blocks \[4, 4\] sum to 8, but dim 0 is 16 wide"):
        packed_blocks_piece(torch.arange(16), 0, [4, 4], 2, 0, "m")
    with pytest.raises(LocalViewError, match=r"do not divide into 3 equal pieces"):
        packed_blocks_piece(torch.arange(16), 0, [4, 4, 8], 3, 0, "m")
    with pytest.raises(LocalViewError, match=r"'conv_dim' is not an integer attribute of Mixer"):
        block_sizes(Mixer(), ("conv_dim",), "m")


def test_sizes_are_the_share_and_refuse_what_does_not_divide():
    assert local_sizes(Mixer(), ("num_k_heads", "value_dim"), 2, "m") == {"num_k_heads": 1, "value_dim": 4}
    with pytest.raises(LocalViewError, match=r"m: Mixer.num_k_heads = 2 does not divide into 4 equal shares"):
        local_sizes(Mixer(), ("num_k_heads",), 4, "m")


def test_a_childs_parameter_is_found_by_its_dotted_name():
    mixer = Mixer()
    owner, leaf = owner_of(mixer, "conv1d.weight")
    assert owner is mixer.conv1d and leaf == "weight"
    assert owner_of(mixer, "A_log") == (mixer, "A_log")


def test_a_packed_parameter_placed_other_than_shard_of_its_dim_or_replicated_is_refused():
    """The plan's placement of a packed parameter must be one the loader, checkpoint and
    verify read as packed order (shard of the packed dim) or replicated."""
    from hyper_parallel.config.parallel_dims import ParallelDims
    from hyper_parallel.planning.plan_lint import PlanError, _lint_local_views
    from hyper_parallel.planning.offline_mesh import build_offline_mesh
    from hyper_parallel.protocols.sharding import ShardingConfig

    mesh = build_offline_mesh(ParallelDims(tp=2))
    slices = {"conv1d.weight": (0, ("key_dim", "key_dim", "value_dim"))}
    for placement in (Shard(0), Replicate()):
        _lint_local_views("m", Mixer(), ShardingConfig(state_shardings={"conv1d.weight": {"tp": placement}},
                                                       local_map=True, local_slices=slices), mesh)
    with pytest.raises(PlanError, match=r"plan entry for m: conv1d.weight packs blocks along dim 0 \(local_slices\) "
                                        r"but is placed S\(2\) over tp"):
        _lint_local_views("m", Mixer(), ShardingConfig(state_shardings={"conv1d.weight": {"tp": Shard(2)}},
                                                       local_map=True, local_slices=slices), mesh)
