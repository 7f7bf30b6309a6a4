"""sha256 of bytes and files: the one digest that bundles list, signatures, preflight and
the loader compare. A leaf module (stdlib only), so the runtime and the build tool share it."""

import hashlib
from pathlib import Path


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    return sha256_bytes(Path(path).read_bytes())
