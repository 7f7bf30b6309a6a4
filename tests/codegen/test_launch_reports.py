"""How a failed launch names its ranks: a rank that went quiet until the others timed out
is "silent"; a rank left waiting for a rank that failed on its own is not blamed."""

import os
import time

from hyper_parallel.launch.ranks import JOINING, RankFiles, join_process_group, rank_reports


def _files(tmp_path, *, error_after_s: float) -> RankFiles:
    files = RankFiles(str(tmp_path / "run"))
    now = time.time()
    files.report_progress(0, "step 1")
    os.utime(files.progress(0), (now - error_after_s, now - error_after_s))
    files.report_error(1, "rank 1: RuntimeError: boom")
    os.utime(files.error(1), (now, now))
    return files


def test_a_rank_quiet_for_the_timeout_is_named_silent(tmp_path):
    report = rank_reports(_files(tmp_path, error_after_s=30), world=2, collective_timeout_s=30)
    assert report.splitlines()[0] == ("rank(s) 0 went silent (last phase reported: rank 0: 'step 1'); the other "
                                      "ranks gave up waiting for them after 30s (accelerator.check_timeout_s)")


def test_a_rank_waiting_for_a_failed_rank_is_not_blamed(tmp_path):
    report = rank_reports(_files(tmp_path, error_after_s=1), world=2, collective_timeout_s=30)
    assert report.splitlines() == ["rank 1: RuntimeError: boom",
                                   "rank(s) 0 were ended while waiting for the failed rank(s) (last phase reported: "
                                   "rank 0: 'step 1')"]


def _hang_in_init(seconds: float) -> None:
    time.sleep(seconds)


def test_a_rank_hung_while_joining_leaves_its_stack_in_the_report(tmp_path):
    files = RankFiles(str(tmp_path / "run"))
    # the dump fires after max(1 s, 0.8 * timeout) inside init; init returns after that
    assert join_process_group(files, 1, lambda: _hang_in_init(1.6), timeout_s=1.0)
    assert files.progress(1).read_text() == JOINING
    now = time.time()
    os.utime(files.progress(1), (now - 30, now - 30))
    files.report_error(0, "rank 0: joining the process group: DistStoreError: wait timeout, keys: /default_pg/0//cpu//0/1")
    report = rank_reports(files, world=2, collective_timeout_s=30)
    assert report.splitlines()[0].startswith("rank(s) 1 went silent (last phase reported: rank 1: "
                                             "'joining the process group')"), report
    stacks = report.split("rank 1's stacks while it hung (innermost first):\n", 1)[1].splitlines()
    assert stacks[0].strip().endswith("(most recent call first): (the rank's main thread)"), report
    assert "_hang_in_init" in stacks[1], report


def test_a_rank_that_joins_in_time_leaves_no_stack(tmp_path):
    files = RankFiles(str(tmp_path / "run"))
    assert join_process_group(files, 0, lambda: None, timeout_s=1.0)
    time.sleep(1.3)  # past the dump's deadline: it was cancelled
    assert files.stack(0).read_text().startswith("main thread: 0x")
    assert len(files.stack(0).read_text().splitlines()) == 1
    assert "stacks" not in rank_reports(files, world=2, collective_timeout_s=30)


def test_a_failed_join_is_the_rank_s_own_error(tmp_path):
    files = RankFiles(str(tmp_path / "run"))

    def refused():
        raise RuntimeError("connection refused")

    assert not join_process_group(files, 3, refused, timeout_s=60)
    assert files.error(3).read_text() == "rank 3: joining the process group: RuntimeError: connection refused"
