"""Verify compares each whole gradient on rank 0 alone (``gathered_grads._gather``): every
rank's piece is gathered to it, so no other rank holds a whole-sized buffer (at 256 thread
ranks those buffers were most of verify's memory). What it rebuilds must still be what
the ranks hold: a replicated gradient whose copies disagree reports how far apart they
are, a parameter only one rank holds (another pipeline stage's) is rebuilt from that
rank, and an element no rank holds makes every rank raise, not rank 0 alone."""

import pytest
import torch

from hyper_parallel.codegen.check.gathered_grads import _gather, _gather_pieces, _local_piece, _NotHeld
from tests.threaded_world import run_ranks as _run_ranks

WORLD = 4
SHAPE = (3, 4)

def test_replicas_are_averaged_on_rank_0_and_their_disagreement_reported():
    base = torch.arange(12, dtype=torch.float32).reshape(SHAPE)
    results = _run_ranks(WORLD, lambda rank: _gather(base + rank * 0.5, SHAPE, torch.float32))
    whole, spread = results[0]
    assert torch.equal(whole, base + 0.75)  # the mean of the four copies
    assert spread == pytest.approx(2 * 0.75)  # the farthest copy is 0.75 from the mean
    assert all(whole is None for whole, _ in results[1:])  # nothing whole-sized off rank 0


def test_a_parameter_one_rank_holds_is_rebuilt_from_it():
    held = torch.randn(SHAPE)
    results = _run_ranks(WORLD, lambda rank: _gather(held if rank == 2 else None, SHAPE, torch.float32))
    assert torch.equal(results[0][0], held) and results[0][1] == 0.0


def test_an_element_no_rank_holds_fails_every_rank():
    def body(rank):
        try:
            _gather(None, SHAPE, torch.float32)
        except RuntimeError as exc:  # each rank's own error (none is woken by another's)
            return str(exc)
        return "no error"

    assert _run_ranks(WORLD, body) == ["no rank holds some elements of the tensor"] * WORLD


def test_tensors_gathered_in_one_exchange_each_come_back_whole_in_their_own_dtype():
    """All gradients travel together (one exchange, values in a type both dtypes convert
    to and back exactly): each comes back as if gathered alone, bf16 values unchanged."""
    replicated = torch.arange(12, dtype=torch.float32).reshape(SHAPE)
    one_holder = torch.randn(5).to(torch.bfloat16)
    rows = torch.randn(8, 2)

    def body(rank):
        tensors = [(replicated + rank * 0.25, SHAPE, torch.float32),
                   (one_holder if rank == 3 else None, (5,), torch.bfloat16),
                   (rows * (rank + 1), (8, 2), torch.float32)]  # a plain tensor: a whole replica
        return _gather_pieces([_local_piece(t, s, d) for t, s, d in tensors], [(s, d) for _, s, d in tensors])

    results = _run_ranks(WORLD, body)
    (whole, spread), (held, held_spread), (plain, plain_spread) = results[0]
    assert torch.equal(whole, replicated + 0.375) and spread == pytest.approx(2 * 0.375)
    assert held.dtype == torch.bfloat16 and torch.equal(held, one_holder) and held_spread == 0.0
    assert torch.allclose(plain, rows * 2.5) and plain_spread == pytest.approx(2 * (rows * 1.5).abs().max().item())
    assert all(result == [(None, 0.0)] * 3 for result in results[1:])


def test_the_tensor_no_rank_holds_is_named_by_its_position_on_every_rank():
    def body(rank):
        try:
            _gather_pieces([_local_piece(torch.ones(SHAPE), SHAPE, torch.float32),
                            _local_piece(None, (2,), torch.float32)], [(SHAPE, torch.float32), ((2,), torch.float32)])
        except _NotHeld as exc:
            return exc.position
        return "no error"

    assert _run_ranks(WORLD, body) == [1] * WORLD
