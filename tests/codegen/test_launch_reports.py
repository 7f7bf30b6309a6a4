"""How a failed launch names its ranks: a rank that went quiet until the others timed out
is "silent"; a rank left waiting for a rank that failed on its own is not blamed."""

import os
import time

from hyper_parallel.launch.ranks import RankFiles, rank_reports


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
