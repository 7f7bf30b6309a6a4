"""Import edits: relative imports made absolute, and the runtime import added.

The generated file lives outside the transformers package, so ``from ...activations
import ACT2FN`` must become ``from transformers.activations import ACT2FN``. Only the
module part of each statement is rewritten; the imported names, their parentheses and
comments stay as they were.

Remote code (a modeling file shipped in the model folder) imports its siblings
relatively (``from .configuration_fused import FusedConfig``). The bundle is a package
holding copies of those siblings, so these imports stay relative; any other relative
import is resolved as if the file sat in transformers (``transformers/models/<model
type>/``) and must name a transformers module.
"""

import ast
import importlib.util
from collections.abc import Collection
from dataclasses import dataclass

from hyper_parallel.codegen.astkit import (
    SourceModule,
    TextEdit,
    import_from_module_span,
    relative_imports,
    top_level_imports,
)


@dataclass(frozen=True)
class RemoteCode:
    """What the emitter needs to know about a remote-code source: its model_type (where
    it would sit in transformers) and the module names of its siblings."""

    model_type: str
    siblings: tuple[str, ...] = ()


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


def remote_import_edits(source: SourceModule, remote: RemoteCode) -> list[TextEdit]:
    """Edits for a remote modeling file: none for imports of its siblings (module names
    beside it in the model folder), an absolute transformers path for the others."""
    anchor = f"transformers.models.{remote.model_type.replace('-', '_')}"
    siblings = remote.siblings
    edits = []
    for node in relative_imports(source.tree):
        if _imports_siblings(node, siblings):
            continue
        relative = "." * node.level + (node.module or "")
        try:
            absolute = importlib.util.resolve_name(relative, anchor)
        except ImportError:
            absolute = None
        if absolute is None or not _transformers_module_exists(absolute):
            raise ValueError(f"{source.name}:{node.lineno}: relative import {relative!r} names neither a "
                             f"file beside it in the model folder (siblings: {sorted(siblings) or 'none'}) "
                             f"nor a transformers module (resolved as {absolute!r})")
        start, end = import_from_module_span(source, node)
        edits.append(TextEdit(start, end, absolute, why=f"line {node.lineno}: {relative} -> {absolute}"))
    return edits


def _imports_siblings(node: ast.ImportFrom, siblings: Collection[str]) -> bool:
    """``from .sibling import x`` or ``from . import sibling, other_sibling``."""
    if node.level != 1:
        return False
    if node.module is not None:
        return node.module.split(".")[0] in siblings
    return all(alias.name in siblings for alias in node.names)


def _transformers_module_exists(name: str) -> bool:
    if name != "transformers" and not name.startswith("transformers."):
        return False
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent that is not a package
        return False


def add_imports_edit(source: SourceModule, import_lines: list[str], trailer: str = "") -> TextEdit:
    """Insert ``import_lines`` as their own block after the module's leading imports
    (project imports come last, separated by a blank line), then ``trailer`` (module
    level definitions the classes below use) after two blank lines."""
    block = top_level_imports(source.tree)
    text = "".join(line + "\n" for line in import_lines) + (f"\n\n{trailer}" if trailer else "")
    if block:
        at = source.lines.end_of_line(block[-1].end_lineno)
        return TextEdit(at, at, "\n" + text, why="runtime import")
    first = source.tree.body[0] if source.tree.body else None
    at = source.lines.line_start(first.lineno) if first is not None else len(source.text)
    return TextEdit(at, at, text + "\n", why="runtime import")
