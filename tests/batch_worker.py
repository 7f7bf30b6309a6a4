"""The worker side of ``tests/batch_launch.py``: every case of a ``--cases`` file in turn.

Each case's result goes to ``OUT/<name>/rank<N>.json``; a case that raises writes
``OUT/<name>/error_rank<N>.txt`` (its traceback) and ends the rank with exit code 1 at
once, so its peers meet a closed connection instead of waiting in a collective.
"""

import json
import traceback
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from hyper_parallel.distributed.rank_exit import exit_rank


def run_cases(cases_file: str, out_dir: str, run_one: Callable[[list[str]], dict]) -> None:
    """``run_one(flags)`` for every ``{name: flags}`` of ``cases_file``, in file order."""
    for name, flags in json.loads(Path(cases_file).read_text()).items():
        folder = Path(out_dir, name)
        folder.mkdir(parents=True, exist_ok=True)
        try:
            result = run_one(flags)
        except BaseException:  # noqa: B036 (the case is named, then the rank ends)
            rank = dist.get_rank() if dist.is_initialized() else "unknown"
            (folder / f"error_rank{rank}.txt").write_text(traceback.format_exc())
            exit_rank(1)
        (folder / f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
