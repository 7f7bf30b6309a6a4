"""What a training process needs to use a generated bundle, below the build tool.

- ``apply.py``: ``hyper_parallelize`` and ``hyper_apply_replacements``, which generated
  modeling files call (they import this package, ``from hyper_parallel import runtime as
  hyper_parallel_runtime``, and nothing else of ``hyper_parallel``);
- ``meta.py``, ``loader.py``, ``integrity.py``: reading an installed bundle, importing it
  from sha256-checked bytes, and the checks every rank runs before it trains with one;
- ``bundle.py``: ``prepare_bundle``, a rank's whole way from a recipe's spec to an
  imported, checked bundle;
- ``build.py``: the one door to ``codegen/`` (projecting a recipe, building a bundle,
  planning at run time), imported lazily: nothing else here, in ``models/`` or in
  ``trainer/`` imports the build tool.

Attributes are resolved on first use, so torch-free callers (``dodo.py``'s up-to-date
checks read bundle metas through ``runtime.meta``) do not import torch by importing this
package.
"""

import importlib
from typing import Any

_EXPORTS = {
    "REPLACED_RECORD": "apply", "PlanMeshError": "apply", "ReplacementError": "apply",
    "check_plan_layout": "apply", "hyper_apply_replacements": "apply", "hyper_parallelize": "apply",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hyper_parallel.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hyper_parallel.runtime.{_EXPORTS[name]}"), name)
