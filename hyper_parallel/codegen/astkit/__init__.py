"""Locate things in Python source by AST and edit the text at those spans.

Codegen never re-prints a module from its AST: that would drop comments and layout
and make the review diff unreadable. It edits spans of the original text instead.
"""

from hyper_parallel.codegen.astkit.edits import EditConflictError, TextEdit, apply_text_edits
from hyper_parallel.codegen.astkit.index import (
    SourceModule,
    find_method,
    import_from_module_span,
    relative_imports,
    self_method_call_statements,
    top_level_classes,
    top_level_imports,
)
from hyper_parallel.codegen.astkit.spans import LineOffsets

__all__ = [
    "EditConflictError",
    "LineOffsets",
    "SourceModule",
    "TextEdit",
    "apply_text_edits",
    "find_method",
    "import_from_module_span",
    "relative_imports",
    "self_method_call_statements",
    "top_level_classes",
    "top_level_imports",
]
