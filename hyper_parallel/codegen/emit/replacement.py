"""Lower the recipe's ``replace_module`` entries into the generated model.

The entries become a literal ``HYPER_REPLACEMENTS`` list, and every model class whose
``__init__`` calls ``self.post_init()`` gets one line before that call::

    hyper_parallel_runtime.hyper_apply_replacements(self, HYPER_REPLACEMENTS)

The list is defined right after the imports, before the classes that use it.
Replacing before ``post_init`` lets HF initialize (and later load) the weights of the
new modules like any other. Both the base model (``Qwen3MoeModel``) and the head
(``Qwen3MoeForCausalLM``) carry the line: the base model's call replaces the layers as
soon as they exist, the head's call skips modules that are already replaced, so each
module is replaced exactly once whichever class is built (see
``hyper_parallel.runtime.hyper_apply_replacements``).
"""

from typing import Any

from hyper_parallel.codegen.astkit import (
    SourceModule,
    TextEdit,
    find_method,
    self_method_call_statements,
    top_level_classes,
)
from hyper_parallel.codegen.emit.literal import render_literal

APPLY_CALL = "hyper_parallel_runtime.hyper_apply_replacements(self, HYPER_REPLACEMENTS)"


def render_replacements(replacements: list[dict[str, Any]]) -> str:
    """``replacements``: the runtime entries of the recipe's typed overrides
    (``replacement_entries``), already checked and in a fixed key order; each is shown
    without its defaults (no kwargs, not exact_type) or the pipeline's own bookkeeping
    (``origin``): what a reviewer needs, nothing more."""
    shown = [{key: value for key, value in entry.items() if key != "origin" and value not in ({}, False, None)}
             for entry in replacements]
    return ("# The recipe's replace_module entries; every model __init__ applies them before\n"
            "# self.post_init(), so training sees the structure the plan was derived on.\n"
            f"HYPER_REPLACEMENTS = {render_literal(shown)}\n")


def replacement_call_edits(source: SourceModule) -> list[TextEdit]:
    """Insert :data:`APPLY_CALL` before each ``self.post_init()`` in a class ``__init__``."""
    edits = []
    for cls in top_level_classes(source.tree):
        init = find_method(cls, "__init__")
        if init is None:
            continue
        for stmt in self_method_call_statements(init, "post_init"):
            try:
                indent = source.lines.indent_of(stmt)
            except ValueError as exc:
                raise ValueError(f"{source.name}: class {cls.name}: {exc}") from None
            at = source.lines.line_start(stmt.lineno)
            edits.append(TextEdit(at, at, f"{indent}{APPLY_CALL}\n", why=f"{cls.name}.__init__ replacements"))
    if not edits:
        raise ValueError(f"{source.name}: no class __init__ calls self.post_init(); "
                         f"cannot apply the recipe's replace_module entries in the generated model")
    return edits
