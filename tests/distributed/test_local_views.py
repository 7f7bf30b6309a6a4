"""One rank's share of a module run on its heads (``local_views``): the packed blocks of
unequal sizes, the size attributes, and the errors that name what does not divide."""

import pytest
import torch
from torch import nn

from hyper_parallel.distributed.local_views import (
    LocalViewError,
    block_sizes,
    local_sizes,
    owner_of,
    packed_blocks_piece,
)


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
