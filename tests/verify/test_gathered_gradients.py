"""Verify compares each whole gradient on rank 0 alone (``verify_worker._gather``): every
rank's piece is gathered to it, so no other rank holds a whole-sized buffer (at 256 thread
ranks those buffers were most of verify's memory). What it rebuilds must still be what
the ranks hold: a replicated gradient whose copies disagree reports how far apart they
are, a parameter only one rank holds (another pipeline stage's) is rebuilt from that
rank, and an element no rank holds makes every rank raise, not rank 0 alone."""

import pytest
import torch

from hyper_parallel.codegen.check.verify_worker import _gather
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
