"""The load-balanced order's chunk concatenations equal the positions they stand for:
``SequenceOrder.permute`` / ``restore`` are ``index_select`` by ``balanced_order`` and its
inverse, and ``CpAttention.local_rows`` is ``index_select`` by the rank's positions, on any
dim, for cp 1..4 with and without load balance."""

import pytest
import torch

from hyper_parallel.distributed.context_parallel import (
    ContextParallelAttentionError,
    CpAttention,
    SequenceOrder,
    balanced_order,
)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_permute_and_restore_are_the_balanced_positions(cp, dim):
    length = 2 * cp * 3
    shape = [5, 5, 5]
    shape[dim] = length
    tensor = torch.randn(shape)
    order = SequenceOrder(cp)
    positions = balanced_order(length, cp)
    assert torch.equal(order.permute(tensor, dim), tensor.index_select(dim, positions))
    assert torch.equal(order.restore(order.permute(tensor, dim), dim), tensor)
    assert torch.equal(order.restore(tensor, dim), tensor.index_select(dim, torch.argsort(positions)))


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("balanced", [True, False])
def test_local_rows_are_the_rank_s_positions(cp, balanced):
    length = 2 * cp * 4
    table = torch.randn(1, length, 8)
    for rank in range(cp):
        context = CpAttention(None, cp, rank, SequenceOrder(cp) if balanced else None, "eager")
        positions = context.local_positions(length, table.device)
        assert positions.numel() == length // cp
        assert torch.equal(context.local_rows(table, 1), table.index_select(1, positions))


def test_a_length_the_chunks_do_not_divide_is_refused_naming_the_key():
    with pytest.raises(ContextParallelAttentionError, match="accelerator.context_parallel.load_balance"):
        SequenceOrder(2).permute(torch.zeros(1, 6), 1)
