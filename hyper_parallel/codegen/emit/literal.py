"""Render JSON-like data as a Python literal that reads like hand-written code.

A container that fits on one line stays on one line; otherwise each item goes on its
own line, indented by four spaces, with a trailing comma (the layout black would
choose). Dict order is kept as given: callers pass data in a meaningful, deterministic
order (model order for plan modules, mesh order for axes). A dict value that is a
string too long for its key's line starts on the next line, one level deeper; one too
long for that line too is split where it has a ``" | "`` separator (the plan's entry
lines) into adjacent literals, which Python concatenates back to the same string (inside
the dict's braces no parentheses are needed).
"""

import math
import textwrap
from collections.abc import Iterable
from typing import Any

INDENT = "    "
WIDTH = 119  # transformers' own line length, which the rest of the generated file follows


def comment_block(lines: Iterable[str], *, width: int = WIDTH) -> str:
    """``lines`` as ``# `` comments; a long one continues indented, never splitting words
    (a path stays whole)."""
    wrapped = [part for line in lines
               for part in textwrap.wrap(line, width=width - 2, subsequent_indent="  ",
                                         break_long_words=False, break_on_hyphens=False)]
    return "".join(f"# {line}".rstrip() + "\n" for line in wrapped)


def render_literal(value: Any, *, indent: int = 0, width: int = WIDTH) -> str:
    """``value`` (dict/list/tuple/str/int/float/bool/None) as Python source text whose
    first line continues a line already indented by ``indent`` levels."""
    return _render(value, indent, len(INDENT * indent), width)


def _render(value: Any, indent: int, used: int, width: int) -> str:
    flat = _flat(value)
    if used + len(flat) + 1 <= width or not _is_container(value) or not value:
        return flat
    inner = INDENT * (indent + 1)
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            head = f"{inner}{_flat(key)}: "
            if isinstance(item, str) and len(head) + len(_flat(item)) + 1 > width:
                lines.append(f"{head.rstrip()}\n{_hanging_string(item, inner + INDENT, width)},")
            else:
                lines.append(f"{head}{_render(item, indent + 1, len(head), width)},")
    else:
        lines = [f"{inner}{_render(item, indent + 1, len(inner), width)}," for item in value]
    opening, closing = {dict: "{}", list: "[]", tuple: "()"}[type(value)]
    return opening + "\n" + "\n".join(lines) + "\n" + INDENT * indent + closing


SEPARATOR = " | "


def _hanging_string(text: str, indent: str, width: int) -> str:
    """``text`` on lines of its own at ``indent``: cut before a separator where it does not
    fit, each line as full as ``width`` allows (a piece longer than that gets a line of its
    own; a string without a separator stays whole)."""
    first, *rest = text.split(SEPARATOR)
    lines = [first]
    for piece in rest:
        candidate = lines[-1] + SEPARATOR + piece
        if len(indent) + len(_string(candidate)) + 1 <= width:
            lines[-1] = candidate
        else:
            lines.append(SEPARATOR + piece)
    return "\n".join(f"{indent}{_string(line)}" for line in lines)


def _is_container(value: Any) -> bool:
    return isinstance(value, (dict, list, tuple))


def _flat(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_flat(key)}: {_flat(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_flat(item) for item in value) + "]"
    if isinstance(value, tuple):
        inner = ", ".join(_flat(item) for item in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, float) and not math.isfinite(value):
        raise TypeError(f"cannot render {value!r} as a literal; expected a finite number")
    if isinstance(value, str):
        return _string(value)
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    raise TypeError(f"cannot render {type(value).__name__} {value!r} as a literal; "
                    f"expected dict, list, tuple, str, int, float, bool or None")


def _string(text: str) -> str:
    """repr() with double quotes, the usual style of hand-written code."""
    quoted = repr(text)
    if quoted.startswith("'") and '"' not in text:
        return '"' + quoted[1:-1] + '"'
    return quoted
