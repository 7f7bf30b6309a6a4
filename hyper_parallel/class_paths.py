"""The dotted names a recipe may use for a class (``module_type`` / ``exact_type``).

Imports only the standard library: generated modeling files reach it at import time.
"""

import sys

# transformers imports a model folder's remote code as transformers_modules.<folder>.<hash>.<module>.
REMOTE_CODE_PACKAGE = "transformers_modules."


def class_paths(cls: type) -> list[str]:
    """``cls``'s own dotted name, then the names it also answers to: for a class defined
    in a generated modeling file, the same class in the module it was generated from
    (HF's dotted module, or for remote code the module's name in the model folder); for
    remote code as transformers loads it, ``<module>.<Class>`` — the model folder's
    spelling, as in ``auto_map`` (``modeling_fused.FusedAttention``)."""
    own = f"{cls.__module__}.{cls.__qualname__}"
    paths = [own]
    source = getattr(sys.modules.get(cls.__module__), "HYPER_SOURCE_MODULE", None)
    if isinstance(source, str):
        paths.append(f"{source}.{cls.__qualname__}")
    if cls.__module__.startswith(REMOTE_CODE_PACKAGE):
        paths.append(f"{cls.__module__.rpartition('.')[2]}.{cls.__qualname__}")
    return paths
