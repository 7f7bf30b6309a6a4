"""How a failed launch names its ranks: a rank that went quiet until the others timed out
is "silent"; a rank left waiting for a rank that failed on its own is not blamed."""

import os
import threading
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


def _hang_until(released: threading.Event) -> None:
    released.wait(30)


def test_a_rank_hung_while_joining_leaves_its_stack_in_the_report(tmp_path):
    files = RankFiles(str(tmp_path / "run"))
    released = threading.Event()
    # the join hangs in a thread of this process (the dump covers every thread, main first)
    joining = threading.Thread(target=join_process_group, args=(files, 1, lambda: _hang_until(released), 1.0))
    joining.start()
    try:
        deadline = time.time() + 20
        while "_hang_until" not in (files.stack(1).read_text() if files.stack(1).is_file() else ""):
            assert time.time() < deadline, "no dump after 0.8 * timeout_s"
            time.sleep(0.1)
        assert files.progress(1).read_text() == JOINING
        now = time.time()
        os.utime(files.progress(1), (now - 30, now - 30))
        files.report_error(0, "rank 0: joining the process group: DistStoreError: wait timeout, keys: "
                              "/default_pg/0//cpu//0/1")
        report = rank_reports(files, world=2, collective_timeout_s=30)
    finally:
        released.set()
        joining.join()
    assert report.splitlines()[0].startswith("rank(s) 1 went silent (last phase reported: rank 1: "
                                             "'joining the process group')"), report
    stacks = report.split("rank 1's stacks while it hung (innermost first):\n", 1)[1].splitlines()
    assert stacks[0].strip().endswith("(most recent call first): (the rank's main thread)"), report
    assert any("_hang_until" in line for line in stacks), report  # where the join hung
    assert files.stack(1).read_text() == ""  # released, it joined: no stale stack for a later phase


def test_a_rank_that_joins_in_time_leaves_no_stack(tmp_path):
    files = RankFiles(str(tmp_path / "run"))
    assert join_process_group(files, 0, lambda: None, timeout_s=1.0)
    time.sleep(1.3)  # past the dump's deadline: it was cancelled
    assert files.stack(0).read_text() == ""
    assert "stacks" not in rank_reports(files, world=2, collective_timeout_s=30)


def test_a_slow_join_that_succeeded_is_not_shown_as_a_later_hang(tmp_path):
    files = RankFiles(str(tmp_path / "run"))
    assert join_process_group(files, 0, lambda: _hang_in_init(1.6), timeout_s=1.0)  # the dump fired, then it joined
    files.report_progress(0, "step 3")
    now = time.time()
    os.utime(files.progress(0), (now - 30, now - 30))
    files.report_error(1, "rank 1: RuntimeError: collective timed out")
    report = rank_reports(files, world=2, collective_timeout_s=30)
    assert "rank(s) 0 went silent (last phase reported: rank 0: 'step 3')" in report
    assert "stacks" not in report, report


def test_a_failed_join_is_the_rank_s_own_error(tmp_path):
    files = RankFiles(str(tmp_path / "run"))

    def refused():
        raise RuntimeError("connection refused")

    assert not join_process_group(files, 3, refused, timeout_s=60)
    assert files.error(3).read_text() == "rank 3: joining the process group: RuntimeError: connection refused"
