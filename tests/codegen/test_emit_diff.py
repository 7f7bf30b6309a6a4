"""emit.diff: the review diff of a generated file."""

import pytest

from hyper_parallel.codegen.emit.diff import unified_diff_text


def test_diff_uses_relative_names_and_is_deterministic():
    original = "a = 1\nb = 2\nc = 3\n"
    generated = "a = 1\nb = 20\nc = 3\nd = 4\n"
    diff = unified_diff_text(original, "transformers/models/x/modeling_x.py", generated, "modeling_X_gen_cpu.py")
    assert diff == unified_diff_text(original, "transformers/models/x/modeling_x.py",
                                     generated, "modeling_X_gen_cpu.py")
    assert diff.splitlines() == [
        "--- a/transformers/models/x/modeling_x.py",
        "+++ b/modeling_X_gen_cpu.py",
        "@@ -1,3 +1,4 @@",
        " a = 1",
        "-b = 2",
        "+b = 20",
        " c = 3",
        "+d = 4",
    ]


def test_diff_marks_a_missing_final_newline():
    diff = unified_diff_text("a\n", "x.py", "a\nb", "y.py")
    assert diff.endswith("+b\n\\ No newline at end of file\n")


def test_diff_rejects_absolute_names():
    with pytest.raises(ValueError, match="relative"):
        unified_diff_text("a\n", "/abs/x.py", "b\n", "y.py")


def test_identical_texts_give_an_empty_diff():
    assert unified_diff_text("a\n", "x.py", "a\n", "y.py") == ""
