"""Verify's first-divergence diagnosis reads each rank's module outputs as the plan left them."""

import torch

from hyper_parallel.codegen.check.verify import _partial_sum, _reassemble


def _coords(tp: int, cp: int = 1) -> list[dict]:
    return [{"cp": c, "tp": t} for c in range(cp) for t in range(tp)]


def test_a_partial_sum_over_tp_is_summed_over_rank_zeros_tp_group():
    # a rowwise projection hands on its term of the sum: full shape on every rank, and
    # rank 0's own term differs from the reference while the tp group's sum equals it
    want = torch.randn(1, 8, 4)
    term = torch.randn(1, 8, 4)
    coords = _coords(tp=2, cp=2)
    ranks = [{"o": term}, {"o": want - term}, {"o": torch.zeros(1, 8, 4)}, {"o": want}]
    assert not torch.allclose(_reassemble("o", want, ranks, coords), want)
    assert torch.allclose(_partial_sum("o", want, ranks, coords), want)


def test_no_partial_sum_without_tp_or_for_split_outputs():
    want = torch.randn(1, 8, 4)
    assert _partial_sum("o", want, [{"o": want}, {"o": want}], _coords(tp=1, cp=2)) is None
    halves = [{"o": want[:, :4]}, {"o": want[:, 4:]}]
    assert _partial_sum("o", want, halves, _coords(tp=2)) is None
    assert torch.equal(_reassemble("o", want, halves, _coords(tp=2)), want)
