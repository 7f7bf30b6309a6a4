"""The exchanges context parallel and the partial gradients run on gloo
(``distributed/exchange.py``: all-to-alls in which a rank sends nothing to itself) give
what the collectives they stand for give, and uneven rows (none to some peers) arrive
from the rank that sent them, on every rank: the first, a middle and the last
(world 3: the reduce-scatter's sent buffer is then a copy, not a view). And a waited
exchange holds nothing it sent: the all-gather's sent K/V and the reduce-scatter's
whole-sequence gradients were kept alive for as long as the wait function lived (the
attention's whole backward)."""

import json

import pytest

from tests.launch import assert_ran, torchrun
from tests.project_fixtures import REPO


@pytest.mark.parametrize("world", [2, 3])
def test_exchanges_match_the_collectives_and_free_what_they_sent(world, tmp_path):
    proc = torchrun(["-m", "tests.distributed.exchange_worker", str(tmp_path)], REPO, nproc=world, timeout=300)
    assert_ran(proc)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]
    assert [result["rank"] for result in ranks] == list(range(world))
    for result in ranks:
        # four all-to-alls: the all-gather, the reduce-scatter, the (small) all-reduce and
        # the exchange of uneven rows
        assert result == {"rank": result["rank"], "gathered": True, "scattered": True, "reduced": True,
                          "exchanged": True, "exchanges": 4, "sent_freed": True}, ranks
