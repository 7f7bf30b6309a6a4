"""What a training process needs to use a generated bundle, below the build tool.

Generated modeling files import this package (``from hyper_parallel import runtime as
hyper_parallel_runtime``) and nothing else of ``hyper_parallel``: ``hyper_parallelize`` and
``hyper_apply_replacements`` live in ``runtime/apply.py``. ``codegen/`` builds bundles; the
runtime never imports it at module level.
"""

from hyper_parallel.runtime.apply import (
    REPLACED_RECORD,
    PlanMeshError,
    ReplacementError,
    check_plan_layout,
    hyper_apply_replacements,
    hyper_parallelize,
)

__all__ = ["REPLACED_RECORD", "PlanMeshError", "ReplacementError", "check_plan_layout", "hyper_apply_replacements",
           "hyper_parallelize"]
