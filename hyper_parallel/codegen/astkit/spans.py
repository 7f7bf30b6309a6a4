"""Map AST positions to offsets in the source text.

``ast`` reports a line number (1-based) and a column counted in UTF-8 *bytes*; text
edits work on ``str`` offsets. A comment full of emoji before a node is enough to make
the two differ, so every conversion goes through :class:`LineOffsets`.
"""

import ast
import re

# The newlines Python's tokenizer recognizes; str.splitlines() also splits on form
# feeds and unicode separators, which would shift line numbers.
_NEWLINE = re.compile(r"\r\n|\r|\n")


class LineOffsets:
    """Character offset of every line start of one source text."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._starts = [0] + [m.end() for m in _NEWLINE.finditer(text)]

    def line_start(self, lineno: int) -> int:
        return self._starts[lineno - 1]

    def offset(self, lineno: int, col_byte: int) -> int:
        """Offset in ``text`` of (1-based line, UTF-8 byte column)."""
        start = self._starts[lineno - 1]
        end = self._starts[lineno] if lineno < len(self._starts) else len(self.text)
        line = self.text[start:end]
        return start + len(line.encode("utf-8")[:col_byte].decode("utf-8"))

    def node_span(self, node: ast.AST) -> tuple[int, int]:
        """(start, end) offsets of a node that carries end positions."""
        return (self.offset(node.lineno, node.col_offset),
                self.offset(node.end_lineno, node.end_col_offset))

    def indent_of(self, node: ast.AST) -> str:
        """The whitespace before ``node`` on its first line; an error if the node does
        not start its line (e.g. it follows a ``;``), because an inserted statement
        could then not take the same indentation."""
        start = self.line_start(node.lineno)
        prefix = self.text[start:self.offset(node.lineno, node.col_offset)]
        if prefix.strip():
            raise ValueError(
                f"line {node.lineno}: expected the statement to start its line, found {prefix!r} before it")
        return prefix

    def end_of_line(self, lineno: int) -> int:
        """Offset just after the newline that ends ``lineno`` (or the text's end)."""
        return self._starts[lineno] if lineno < len(self._starts) else len(self.text)
