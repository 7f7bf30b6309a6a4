"""Reading ``codegen_meta.json``: what an installed bundle is, what it was built from and
what it covers. The build tool writes it (``codegen/meta.py``); a training process only
reads it, so reading lives here, below codegen."""

import json
from pathlib import Path
from typing import Any

from hyper_parallel.errors import HyperParallelError

META_FILE = "codegen_meta.json"
META_SCHEMA_VERSION = 1
REQUIRED_META_FIELDS = ("schema_version", "signature", "recipe", "source", "model", "parallel",
                        "modeling_file", "outputs", "plan", "verified", "covered", "not_covered")


class MetaError(ValueError, HyperParallelError):
    """A codegen_meta.json that is missing, unreadable or incomplete."""


def load_codegen_meta(bundle_dir: str | Path) -> dict[str, Any]:
    path = Path(bundle_dir) / META_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):  # NotADirectory: a file sits where the bundle goes
        raise MetaError(f"{path}: no bundle here (codegen_meta.json missing); run `doit generate`") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MetaError(f"{path}: unreadable ({exc}); the bundle is damaged, run `doit generate`") from None
    if not isinstance(meta, dict):
        raise MetaError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    missing = [f for f in REQUIRED_META_FIELDS if f not in meta]
    if missing:
        raise MetaError(f"{path}: required field(s) missing: {', '.join(missing)}; run `doit generate`")
    if meta["schema_version"] != META_SCHEMA_VERSION:
        raise MetaError(f"{path}: schema_version: expected {META_SCHEMA_VERSION}, got {meta['schema_version']!r}")
    return meta
