"""astkit: AST positions to text offsets, span edits, and the import module span."""

import ast

import pytest

from hyper_parallel.codegen.astkit import (
    EditConflictError,
    SourceModule,
    TextEdit,
    apply_text_edits,
    find_method,
    import_from_module_span,
    relative_imports,
    self_method_call_statements,
    top_level_classes,
    top_level_imports,
)


def test_edits_replace_and_insert_keep_everything_else():
    text = "alpha beta gamma"
    out = apply_text_edits(text, [TextEdit(6, 10, "BETA"), TextEdit(0, 0, ">"), TextEdit(16, 16, "<")])
    assert out == ">alpha BETA gamma<"


def test_insertions_at_one_offset_keep_their_order_and_may_touch_a_replacement():
    out = apply_text_edits("abc", [TextEdit(1, 1, "1"), TextEdit(1, 2, "B"), TextEdit(1, 1, "2")])
    assert out == "a12Bc"


def test_overlapping_edits_are_rejected_naming_both():
    with pytest.raises(EditConflictError, match=r"'second'.*overlaps.*'first'"):
        apply_text_edits("abcdef", [TextEdit(0, 3, "x", why="first"), TextEdit(2, 4, "y", why="second")])
    with pytest.raises(EditConflictError, match="overlaps"):
        apply_text_edits("abcdef", [TextEdit(1, 4, "x"), TextEdit(2, 2, "inside")])


def test_edit_past_the_end_is_rejected():
    with pytest.raises(EditConflictError, match="past the text"):
        apply_text_edits("abc", [TextEdit(2, 9, "x")])


def test_byte_columns_after_non_ascii_text_map_to_the_right_characters():
    text = 'x = "🚨é"; y = 1\nz = 2\r\nw = 3\n'
    source = SourceModule.parse(text, "demo.py")
    y_assign, w_assign = source.tree.body[1], source.tree.body[3]
    start, end = source.lines.node_span(y_assign)
    assert text[start:end] == "y = 1"
    start, end = source.lines.node_span(w_assign)
    assert text[start:end] == "w = 3"


def test_import_module_span_covers_only_the_module_part():
    text = (
        "# 🚨 header\n"
        "from ...pkg.mod import (  # keep me\n"
        "    a,\n"
        "    b,  # and me\n"
        ")\n"
        "from . import sibling\n"
        "from .x import y\n"
        "if True:\n"
        "    from ..up import z  # nested\n"
    )
    source = SourceModule.parse(text, "demo.py")
    spans = [text[slice(*import_from_module_span(source, node))] for node in relative_imports(source.tree)]
    assert spans == ["...pkg.mod", ".", ".x", "..up"]


def test_finders_locate_imports_classes_methods_and_self_calls():
    text = (
        '"""doc"""\n'
        "import os\n"
        "from a import b\n"
        "X = 1\n"
        "import late\n"
        "class M:\n"
        "    def __init__(self):\n"
        "        if True:\n"
        "            self.post_init()\n"
        "        def inner(self):\n"
        "            self.post_init()\n"
        "        other.post_init()\n"
        "        self.post_init()\n"
    )
    tree = ast.parse(text)
    assert [type(n).__name__ for n in top_level_imports(tree)] == ["Import", "ImportFrom"]
    init = find_method(next(c for c in top_level_classes(tree) if c.name == "M"), "__init__")
    assert [stmt.lineno for stmt in self_method_call_statements(init, "post_init")] == [9, 13]
