"""emit: write the generated modeling file and its review diff."""

from hyper_parallel.codegen.emit.diff import unified_diff_text
from hyper_parallel.codegen.emit.modeling import emit_modeling_source

__all__ = ["emit_modeling_source", "unified_diff_text"]
