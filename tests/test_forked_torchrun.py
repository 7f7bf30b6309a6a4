"""Ranks forked from torchrun's agent (``launch/forked_torchrun``) are handed numeric
loopback addresses, so that none of them looks up a host name: a fork inherits locks the
agent's other threads held, and a rank was seen hung for good on glibc's resolver lock in
``init_process_group``. Checked on real ranks: what each was handed, and that gloo joins
and sums over it; and that no rank goes on before the agent has forked them all
(``ForkGate``: a rank was also seen hung on that lock in its own reverse lookup, with a
numeric address)."""

import json
import os
import time

import pytest

from hyper_parallel.launch.forked_torchrun import LOOPBACK_ADDRESS, ForkGate, loopback_interface
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


def test_no_rank_starts_before_the_agent_has_forked_them_all():
    """``ForkGate`` as the agent uses it: each fork of a rank counted in the parent, each
    rank waiting in the child; the ranks go on only after the last fork."""
    gate, started = ForkGate(2, timeout_s=20), os.pipe()
    children = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:  # the rank: wait, then report when it went on
            gate.wait()
            os.write(started[1], f"{time.monotonic()}\n".encode())
            os._exit(0)
        children.append(pid)
        if rank == 1:
            last_fork = time.monotonic()
        gate.forked()
        if rank == 0:
            time.sleep(0.5)  # the agent still forking: rank 0, forked and counted, must not go on
    for pid in children:
        os.waitpid(pid, 0)
    os.close(started[1])
    with os.fdopen(started[0]) as out:
        times = [float(line) for line in out.read().split()]
    assert len(times) == 2 and min(times) >= last_fork, (times, last_fork)
