"""FSDP2's units (distributed/fsdp.py): each decoder layer is a unit of its own unless it
shares parameters with another layer (a block reached from several layers, as Zamba's
shared transformer is): such layers are left to the root unit, since a parameter cannot
be sharded by two units."""

from torch import nn

from hyper_parallel.distributed.fsdp import units_of_their_own


def test_layers_sharing_a_block_are_left_to_the_root():
    shared = nn.Linear(4, 4)
    layers = [nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4), shared),
              nn.Sequential(nn.Linear(4, 4), shared), nn.Sequential(nn.Linear(4, 4))]
    assert units_of_their_own(layers) == [layers[0], layers[3]]
    assert units_of_their_own(layers[:1] + layers[3:]) == [layers[0], layers[3]]
