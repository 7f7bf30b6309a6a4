"""Which boundary conversions take the one-collective path, and which stay with DTensor
(the rules mirror DTensor's from_local -> redistribute -> to_local gradient semantics)."""

from torch.distributed.tensor import Partial, Replicate, Shard

from hyper_parallel.distributed.boundary_collectives import input_reductions, output_reductions
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
