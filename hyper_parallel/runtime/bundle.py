"""``prepare_bundle``: a rank's way from the recipe's spec to an imported, checked bundle.

Rank 0 builds or reuses the bundle through the build tool's door (``runtime/build.py``),
which under torchrun also sends its bytes to every node; then every rank runs the
integrity checks and compares its bundle digest with every other rank's
(``runtime/integrity.py``), and imports the bundle from its sha256-checked bytes
(``runtime/loader.py``).
"""

from pathlib import Path
from typing import Any

from hyper_parallel.runtime import build
from hyper_parallel.runtime.integrity import integrity_across_ranks
from hyper_parallel.runtime.loader import load_generated_module
from hyper_parallel.runtime.meta import load_codegen_meta


def prepare_bundle(spec: Any, *, rank: int | None = None,
                   timeout_s: float | None = None) -> tuple[Path, Any, dict[str, Any], str]:
    """Returns (bundle dir, modeling module, meta, the fix command its errors name)."""
    signature, fix = build.build_bundle(spec, rank=rank, timeout_s=timeout_s)
    integrity_across_ranks(spec.bundle_dir, expected_signature=signature, fix=fix)
    return spec.bundle_dir, load_generated_module(spec.bundle_dir), load_codegen_meta(spec.bundle_dir), fix
