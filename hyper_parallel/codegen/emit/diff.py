"""The review diff of a generated modeling file against its HF source."""

import difflib
import re

# Python's newlines only: str.splitlines() would also split at form feeds and
# unicode separators inside strings and comments.
_LINE = re.compile(r".*?(?:\r\n|\r|\n)|.+\Z", re.S)


def unified_diff_text(original_text: str, original_name: str, generated_text: str, generated_name: str) -> str:
    """A unified diff (3 lines of context) from ``a/<original_name>`` to
    ``b/<generated_name>``. Names must be relative: the diff is part of the bundle,
    and an absolute path would differ between checkouts."""
    for name in (original_name, generated_name):
        if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
            raise ValueError(f"diff file names must be relative, got {name!r}")
    lines = difflib.unified_diff(
        _lines(original_text), _lines(generated_text),
        fromfile=f"a/{original_name}", tofile=f"b/{generated_name}", n=3)
    return "".join(_terminated(line) for line in lines)


def _terminated(line: str) -> str:
    # A last line without a newline would run into the next diff line.
    return line if line.endswith(("\n", "\r")) else line + "\n\\ No newline at end of file\n"


def _lines(text: str) -> list[str]:
    return _LINE.findall(text)
