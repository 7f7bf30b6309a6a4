"""Import edits: relative imports made absolute, and the runtime import added.

The generated file lives outside the transformers package, so ``from ...activations
import ACT2FN`` must become ``from transformers.activations import ACT2FN``. Only the
module part of each statement is rewritten; the imported names, their parentheses and
comments stay as they were.
"""

import importlib.util

from hyper_parallel.codegen.astkit import (
    SourceModule,
    TextEdit,
    import_from_module_span,
    relative_imports,
    top_level_imports,
)


def absolute_import_edits(source: SourceModule, module_name: str) -> list[TextEdit]:
    """One edit per relative import of ``source``, resolved against the package of
    ``module_name`` (the dotted name the HF file is imported under)."""
    package = module_name.rpartition(".")[0]
    edits = []
    for node in relative_imports(source.tree):
        relative = "." * node.level + (node.module or "")
        try:
            absolute = importlib.util.resolve_name(relative, package)
        except ImportError as exc:
            raise ValueError(f"{source.name}:{node.lineno}: cannot make {relative!r} absolute "
                             f"from package {package!r}: {exc}") from None
        start, end = import_from_module_span(source, node)
        edits.append(TextEdit(start, end, absolute, why=f"line {node.lineno}: {relative} -> {absolute}"))
    return edits


def add_imports_edit(source: SourceModule, import_lines: list[str]) -> TextEdit:
    """Insert ``import_lines`` as their own block after the module's leading imports
    (project imports come last, separated by a blank line)."""
    block = top_level_imports(source.tree)
    text = "".join(line + "\n" for line in import_lines)
    if block:
        at = source.lines.end_of_line(block[-1].end_lineno)
        return TextEdit(at, at, "\n" + text, why="runtime import")
    first = source.tree.body[0] if source.tree.body else None
    at = source.lines.line_start(first.lineno) if first is not None else len(source.text)
    return TextEdit(at, at, text + "\n", why="runtime import")
