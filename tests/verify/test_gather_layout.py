"""Verify rebuilds each whole gradient from the ranks' local pieces
(``gathered_grads.local_elements``). Under tp and FSDP2 over dp, a fused gate/up projection
(packed over tp, [gate | up] per rank) is held as FSDP2's plain split of the rank's
packed piece, which DTensor's nested strided placements do not describe: read in mesh
order, the rows were put back in the wrong places and verify refused a right plan
(MiniMax-M3's shared experts at tp2 with dp2). Checked here against where FSDP2 really
puts each row, under torchrun at world 4."""

import json

import pytest

from tests.launch import assert_ran, torchrun
from tests.project_fixtures import REPO

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_each_rank_holds_the_rows_local_elements_names(tmp_path):
    run = torchrun(["-m", "tests.verify.gather_layout_worker", "--out", str(tmp_path)], cwd=REPO, nproc=4, timeout=300)
    assert_ran(run)
    held_packed = []
    for rank in range(4):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, result in results.items():
            assert result["computed"] == result["held"], (rank, name, result)
        held_packed.append(results["packed"]["held"])
    # the packed case is the one mesh order gets wrong: rank (dp 0, tp 0) holds the first
    # quarter of the gate half and nothing of the up half
    assert held_packed[0] == [0, 1, 2, 3], held_packed
