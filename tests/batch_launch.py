"""Several layouts of one worker in one torchrun launch per world size, each test reading
its own layout's results.

A torchrun launch costs seconds of rank start-up (python, torch, transformers) before
its worker does anything; a parametrized test that launched once per layout paid it per
layout. A worker that takes ``--cases FILE`` (a JSON object ``{name: [flags...]}``) runs
every layout of the file in turn in the same ranks and writes ``OUT/<name>/rank<N>.json``;
a layout that raises writes ``OUT/<name>/error_rank<N>.txt`` and ends its rank, so the
layouts after it have no results (``tests/batch_worker.run_cases``, which the workers of
context parallel, tp equivalence and the sharded load call).

``Batches(root, cases, launch)`` launches a world size's batch the first time one of its
layouts is asked for (``launch(world, out, cases_file)`` starts the worker) and hands each
test its layout's per-rank results, failing by the layout's name: the layout that raised
(its traceback), or one that did not run because an earlier layout of its batch raised.
"""

import json
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from tests.launch import assert_ran


class Batches:
    def __init__(self, root: Path, cases: dict[str, tuple[int, list[str]]],
                 launch: Callable[[int, Path, Path], subprocess.CompletedProcess]):
        self.root, self.cases, self.launch = root, cases, launch
        self.launches: dict[int, tuple[subprocess.CompletedProcess, Path]] = {}

    def results(self, case: str) -> list[dict]:
        """The per-rank results of ``case``, its batch launched if it was not yet."""
        world = self.cases[case][0]
        if world not in self.launches:
            out = self.root / f"world{world}"
            out.mkdir(parents=True)
            batch = {name: flags for name, (size, flags) in sorted(self.cases.items()) if size == world}
            (out / "cases.json").write_text(json.dumps(batch))
            self.launches[world] = (self.launch(world, out, out / "cases.json"), out)
        run, out = self.launches[world]
        folder = out / case
        errors = sorted(folder.glob("error_rank*.txt")) if folder.is_dir() else []
        assert not errors, f"layout {case} raised:\n" + "\n".join(e.read_text() for e in errors)
        files = [folder / f"rank{rank}.json" for rank in range(world)]
        if not all(f.is_file() for f in files):
            failed = sorted({e.parent.name for e in out.glob("*/error_rank*.txt")})
            pytest.fail(f"layout {case} did not run: the world-{world} batch stopped at "
                        f"{failed or 'no layout (the launch itself failed)'}\n"
                        f"{run.stdout[-4000:]}\n{run.stderr[-4000:]}")
        if not any(out.glob("*/error_rank*.txt")):  # else the layout that raised fails, by name
            assert_ran(run)  # the ranks left cleanly
        return [json.loads(f.read_text()) for f in files]
