"""Ranks forked from torchrun's agent (``launch/forked_torchrun``) are handed numeric
loopback addresses, so that none of them looks up a host name: a fork inherits locks the
agent's other threads held, and a rank was seen hung for good on glibc's resolver lock in
``init_process_group``. Checked on real ranks: what each was handed, and that gloo joins
and sums over it."""

import json

import pytest

from hyper_parallel.launch.forked_torchrun import LOOPBACK_ADDRESS, loopback_interface
from tests.launch import assert_ran, torchrun
from tests.project_fixtures import REPO

pytestmark = pytest.mark.distributed


def test_forked_ranks_use_loopback_addresses_and_join(tmp_path):
    proc = torchrun(["-m", "tests.forked_torchrun_worker", str(tmp_path)], REPO, nproc=3, timeout=300)
    assert_ran(proc)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    interface = loopback_interface()
    assert interface is not None
    for report in reports:
        assert report == {"MASTER_ADDR": LOOPBACK_ADDRESS, "GLOO_SOCKET_IFNAME": interface, "sum": 6.0, "world": 3}
