"""The family sweep's reason for a training launch that failed is never empty: torchrun's
exit code, the rank that failed first and how (signal names), how far it got, and the
rank's exception or its last stderr lines (torchrun's own report left out)."""

from pathlib import Path

from hyper_parallel.testing.family_case import exit_text, training_crash

PROJECT = Path("/tmp/family_sweep_x/project")
LAUNCHER = """W1201 02:40:35.362000 4953 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending \
process 5003 closing signal SIGTERM
E1201 02:40:35.394000 4953 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: \
{code}) local_rank: {rank} (pid: 5002) of binary: /usr/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
hyper_parallel.trainer FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_02:40:35
  host      : localhost
  rank      : {other} (local_rank: {other})
  exitcode  : -15 (pid: 5003)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 5003
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_02:40:35
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 5002)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 5002
======================================================
"""
STEPS = "step 1/3 | loss 5.52 | grad norm 2.47 | 75 tok/s | 0.43s\nstep 3/3 | loss 5.54 | grad norm 2.61 | 197 tok/s\n"


def test_abort_after_training_names_the_signal_and_the_last_line():
    """What the sweep once reported as ``train (gen backend) crashed: :`` (llama cp2)."""
    stderr = "terminate called without an active exception\n" + LAUNCHER.format(code=-6, rank=0, other=1)
    reason = training_crash(1, STEPS, stderr, True, PROJECT)
    assert reason == ("train (gen backend) crashed: torchrun exit 1; rank 0 killed by SIGABRT (exit -6) "
                      "(also rank 1 killed by SIGTERM (exit -15)); after step 3/3, metrics written: "
                      "terminate called without an active exception")


def test_a_rank_exception_is_the_detail_with_project_paths_shortened():
    stderr = (f"[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x.py\", line 5, in <module>\n"
              f"[rank1]: KeyError: 'lm_head.weight missing in {PROJECT}/recipes/llama/model'\n"
              + LAUNCHER.format(code=1, rank=1, other=0))
    reason = training_crash(1, "", stderr, False, PROJECT)
    assert reason == ("train (gen backend) crashed: torchrun exit 1; rank 1 exit 1 (also rank 0 killed by "
                      "SIGTERM (exit -15)): KeyError: 'lm_head.weight missing in recipes/llama/model'")


def test_no_output_at_all_still_says_what_happened():
    assert training_crash(0, "", "", False, PROJECT) == \
        "train (gen backend) crashed: torchrun exit 0 but rank 0 wrote no metrics: no output"
    assert training_crash(-9, "", "", False, PROJECT) == \
        "train (gen backend) crashed: torchrun killed by SIGKILL (exit -9; the out-of-memory killer sends it): no output"


def test_exit_text():
    assert exit_text(3) == "exit 3"
    assert exit_text(-6) == "killed by SIGABRT (exit -6)"
    assert exit_text(-200) == "killed by signal 200 (exit -200)"
    assert exit_text(-9) == "killed by SIGKILL (exit -9; the out-of-memory killer sends it)"
