"""Which boundary conversions take the one-collective path, and which stay with DTensor
(the rules mirror DTensor's from_local -> redistribute -> to_local gradient semantics)."""

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from hyper_parallel.distributed.boundary_collectives import (
    first_rank_share,
    input_reductions,
    output_reductions,
    output_shares,
)
from hyper_parallel.distributed.partial_grads import _summed_dims

R, P, S1 = Replicate(), Partial(), Shard(1)


def test_replicated_input_to_split_work_all_reduces_its_gradient_only_on_the_split_dim():
    # mesh (cp, tp): tokens split over cp (gradient stays split), weights split over tp
    assert input_reductions((S1, R), (S1, R), (S1, P)) == (1,)
    assert input_reductions((R,), (R,), (R,)) == ()  # nothing split: nothing to do


def test_input_conversions_that_move_data_stay_with_dtensor():
    assert input_reductions((S1,), (R,), (R,)) is None  # all-gather (sequence parallel)
    assert input_reductions((R,), (R,), (Shard(0),)) is None
    assert input_reductions((R,), (R,), (Partial("max"),)) is None


def test_partial_output_handed_on_replicated_is_one_forward_all_reduce():
    assert output_reductions((P,), (R,)) == (0,)
    assert output_reductions((S1, P), (S1, P)) == ()  # handed on as a partial sum: no collective
    assert output_reductions((P,), (S1,)) is None  # reduce-scatter (sequence parallel): DTensor
    assert output_reductions((Shard(2),), (R,)) is None  # all-gather of logits: DTensor


def test_partial_parameter_gradients_are_summed_only_where_the_parameter_is_replicated():
    assert _summed_dims((P, Shard(0)), (R, Shard(0))) == (0,)
    assert _summed_dims((P,), (Shard(0),)) is None


def test_a_whole_output_made_a_term_of_a_partial_sum_is_kept_by_the_first_rank_only():
    """An identity expert inside experts whose output is all-reduced over tp: summed over
    the ranks, its output (and the gradient that flows back through it) counts once."""
    assert output_shares((R,), (P,)) == (0,)
    assert output_shares((S1, R), (S1, P)) == (1,)  # (cp, tp): only tp's
    assert output_shares((R,), (R,)) is None and output_shares((P,), (R,)) is None
    value = torch.arange(4.0, requires_grad=True)
    shares = [first_rank_share(value, [cp, tp], (1,)) for cp in (0, 1) for tp in (0, 1)]
    assert [bool(share.any()) for share in shares] == [True, False, True, False]  # tp rank 0 of each cp rank
    torch.stack(shares[:2]).sum().backward()  # the tp ranks of cp rank 0, summed
    assert torch.equal(value.grad, torch.ones(4))  # once, not tp times
