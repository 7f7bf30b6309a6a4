"""Hashing helpers shared by signatures, meta and preflight. No torch imports here."""

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # .../hyper_parallel


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    return sha256_bytes(Path(path).read_bytes())


def canonical_json(value: Any) -> str:
    """The one serialization that signatures hash: sorted keys, no whitespace."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sha256_json(value: Any) -> str:
    return sha256_bytes(canonical_json(value).encode())


@lru_cache(maxsize=None)
def implementation_sha256(parts: tuple[str, ...]) -> str:
    """sha256 over the Python sources of the given parts of the package (files or
    folders relative to ``hyper_parallel/``), keyed by their relative paths."""
    digest = hashlib.sha256()
    for rel in parts:
        base = PACKAGE_ROOT / rel
        files = sorted(base.rglob("*.py")) if base.is_dir() else [base]
        for file in files:
            if "__pycache__" in file.parts or not file.exists():
                continue
            digest.update(file.relative_to(PACKAGE_ROOT).as_posix().encode() + b"\0")
            digest.update(sha256_bytes(file.read_bytes()).encode() + b"\n")
    return digest.hexdigest()
