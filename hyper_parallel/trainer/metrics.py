"""The trainer's metrics file: what rank 0 records of each step, and how it is read back."""

import json
import os
from pathlib import Path


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The step records in a ``--metrics`` file, in order: one JSON object per line (the
    streamed form), or one JSON list (the form written at the end of a run)."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]
