"""A failed torchrun preflight reports the failing rank's own error, not torchrun's
summary that only says a child failed."""

import pytest

from hyper_parallel.launch.ranks import last_error_line as _last_error_line
from tests.launch import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_the_ranks_error_is_reported_not_torchruns_summary(tmp_path):
    worker = tmp_path / "worker.py"
    # One rank fails: two ranks writing the same error at once interleave on stderr.
    worker.write_text("import os\nif os.environ['RANK'] == '1':\n"
                      "    raise ValueError('bundle digest 1 differs from rank 0s 2')\n")
    proc = torchrun([str(worker)], cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "ChildFailedError" in proc.stderr + proc.stdout  # what the old report showed
    assert _last_error_line(proc.stderr + proc.stdout) == "ValueError: bundle digest 1 differs from rank 0s 2"


def test_rank_prefixed_errors_win():
    output = "\n".join(["[rank1]: Traceback (most recent call last):",
                        "[rank1]: RuntimeError: local shard shape (2, 3) on rank 1",
                        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"])
    assert _last_error_line(output) == "[rank1]: RuntimeError: local shard shape (2, 3) on rank 1"
