"""Find the things codegen edits in a parsed module: imports, classes, methods, and
``self.<method>()`` calls. Every finder returns AST nodes; :mod:`spans` turns them
into text offsets."""

import ast
import io
import tokenize
from dataclasses import dataclass

from hyper_parallel.codegen.astkit.spans import LineOffsets


@dataclass(frozen=True)
class SourceModule:
    """A source text, its AST and the offset table that links the two."""

    text: str
    tree: ast.Module
    lines: LineOffsets
    name: str  # the file or module name, for error messages

    @classmethod
    def parse(cls, text: str, name: str) -> "SourceModule":
        try:
            tree = ast.parse(text, filename=name)
        except SyntaxError as exc:
            raise ValueError(f"{name}: not valid Python: {exc}") from None
        return cls(text=text, tree=tree, lines=LineOffsets(text), name=name)


def relative_imports(tree: ast.Module) -> list[ast.ImportFrom]:
    """Every ``from .x import y`` anywhere in the module (also inside functions and
    ``if TYPE_CHECKING:`` blocks), in source order."""
    found = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0]
    return sorted(found, key=lambda node: (node.lineno, node.col_offset))


def top_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """The module's leading import statements (the block after the docstring and
    comments, before the first other statement)."""
    body = list(tree.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # module docstring
    block: list[ast.stmt] = []
    for node in body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            break
        block.append(node)
    return block


def top_level_classes(tree: ast.Module) -> list[ast.ClassDef]:
    return [node for node in tree.body if isinstance(node, ast.ClassDef)]


def find_method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    return None


def self_method_call_statements(func: ast.FunctionDef, method: str) -> list[ast.Expr]:
    """Statements of the form ``self.<method>(...)`` in ``func`` (at any depth, but not
    inside nested functions or classes, whose ``self`` is someone else)."""
    found: list[ast.Expr] = []

    def visit(statements: list[ast.stmt]) -> None:
        for stmt in statements:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if _is_self_call(stmt, method):
                found.append(stmt)
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(stmt, field, []) or [])

    visit(func.body)
    return found


def _is_self_call(stmt: ast.stmt, method: str) -> bool:
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return False
    func = stmt.value.func
    return (isinstance(func, ast.Attribute) and func.attr == method
            and isinstance(func.value, ast.Name) and func.value.id == "self")


def import_from_module_span(source: SourceModule, node: ast.ImportFrom) -> tuple[int, int]:
    """Offsets of the module part of ``from <module> import ...`` (e.g. ``...activations``
    or ``.``), found by tokenizing the statement, so that the names and their layout
    after ``import`` stay untouched."""
    start, end = source.lines.node_span(node)
    segment = source.text[start:end]
    seg_lines = LineOffsets(segment)
    first = last = None
    tokens = tokenize.generate_tokens(io.StringIO(segment).readline)
    next(tokens)  # the `from` keyword
    for tok in tokens:
        if tok.type == tokenize.NAME and tok.string == "import":
            break
        if tok.type in (tokenize.OP, tokenize.NAME):
            tok_start = seg_lines.line_start(tok.start[0]) + tok.start[1]
            first = tok_start if first is None else first
            last = seg_lines.line_start(tok.end[0]) + tok.end[1]
    if first is None or last is None:
        raise ValueError(f"{source.name}:{node.lineno}: cannot find the module of this import")
    return start + first, start + last
