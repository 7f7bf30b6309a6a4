"""Text edits at spans of the original source.

The generated modeling file is the HF source with a few spans replaced; everything
outside those spans stays byte-for-byte, which is what keeps comments, layout and
the review diff small.
"""

from dataclasses import dataclass

from hyper_parallel.errors import HyperParallelError


class EditConflictError(ValueError, HyperParallelError):
    """Two edits touch the same span, or an edit lies outside the text."""


@dataclass(frozen=True, order=True)
class TextEdit:
    """Replace ``text[start:end]`` with ``replacement``; ``start == end`` inserts."""

    start: int
    end: int
    replacement: str
    why: str = ""  # named in conflict errors

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise EditConflictError(f"edit {self.why or self.replacement!r}: bad span [{self.start}, {self.end})")


def apply_text_edits(text: str, edits: list[TextEdit]) -> str:
    """Apply non-overlapping edits in one pass. Insertions at the same offset keep
    the order in which they were given; an insertion may touch a replaced span's
    boundary but not fall inside it."""
    ordered = sorted(enumerate(edits), key=lambda pair: (pair[1].start, pair[1].end, pair[0]))
    pieces: list[str] = []
    cursor = 0
    previous: TextEdit | None = None
    for _, edit in ordered:
        if edit.end > len(text):
            raise EditConflictError(
                f"edit {edit.why or edit.replacement!r}: span [{edit.start}, {edit.end}) "
                f"ends past the text (length {len(text)})")
        if edit.start < cursor:
            raise EditConflictError(
                f"edit {edit.why or edit.replacement!r} at [{edit.start}, {edit.end}) overlaps "
                f"edit {previous.why or previous.replacement!r} at [{previous.start}, {previous.end})")
        pieces.append(text[cursor:edit.start])
        pieces.append(edit.replacement)
        cursor = edit.end
        previous = edit
    pieces.append(text[cursor:])
    return "".join(pieces)
