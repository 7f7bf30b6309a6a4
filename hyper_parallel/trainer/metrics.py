"""The trainer's metrics file: what rank 0 records of each step, and how it is read back.

One JSON object per line, written and flushed as each step ends, so a run killed at any
instant (SIGKILL, a lost host) keeps a complete line for every step it finished: the
kernel holds what was written even when the process never exits."""

import json
import os
from pathlib import Path
from typing import Any


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The step records in a ``--metrics`` file, in order: one JSON object per line (the
    streamed form), or one JSON list (the form older runs wrote at the end)."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


class MetricsStream:
    """Rank 0's ``--metrics`` file, one line per step as it ends.

    A run that resumes at step N keeps the file's lines of steps 1..N (the history its
    checkpoint continues) and drops later ones (steps a killed run did after its last
    checkpoint, which this run does again), so the file stays one consistent history. A
    run that starts from step 0 starts the file afresh. A last line cut off mid-write is
    dropped with the rest."""

    def __init__(self, path: str | os.PathLike, first_step: int):
        self.path = Path(path)
        kept = _lines_up_to(self.path, first_step) if first_step > 0 else []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 (held for the run)
        self._file.writelines(line + "\n" for line in kept)
        self._file.flush()

    def write(self, record: dict[str, Any]) -> None:
        """Append one step's record and hand it to the kernel before the step is over."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _lines_up_to(path: Path, step: int) -> list[str]:
    """The complete JSON lines of ``path`` whose step is at most ``step`` (none when the
    file is missing or in the old list form)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    kept = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line)
    return kept


def write_metrics(records: list, path: str | os.PathLike) -> None:
    """Records of a finished run (``StepRecord``s or dicts) as a metrics file, all at once
    (the streamed file's format)."""
    lines = [json.dumps(r if isinstance(r, dict) else r.__dict__) for r in records]
    Path(path).write_text("".join(line + "\n" for line in lines))
