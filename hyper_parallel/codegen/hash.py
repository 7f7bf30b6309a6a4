"""Hashing helpers shared by signatures, meta and preflight. No torch imports here."""

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from hyper_parallel.errors import HyperParallelError

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


class ImplementationPartMissing(FileNotFoundError, HyperParallelError):
    """A stage's implementation part names a path the package does not have (a module
    was moved or renamed and the stage table was not): hashing it would silently miss
    the code that stage runs."""


@lru_cache(maxsize=None)
def implementation_sha256(parts: tuple[str, ...]) -> str:
    """sha256 over the modules of the given parts of the package (files or folders
    relative to ``hyper_parallel/``), keyed by their relative paths. A part that does not
    exist is an error naming it; only the files Python imports count (see ``part_modules``)."""
    digest = hashlib.sha256()
    for rel in parts:
        for file in part_modules(rel):
            digest.update(file.relative_to(PACKAGE_ROOT).as_posix().encode() + b"\0")
            digest.update(sha256_bytes(file.read_bytes()).encode() + b"\n")
    return digest.hexdigest()


def part_modules(rel: str) -> list[Path]:
    """The tracked files of one implementation part, decided without git (it need not be
    installed where codegen runs): a file part is itself; a folder part is every module
    Python can import from it, ``*.py`` files with identifier names in identifier-named
    folders. That leaves out what is not code of the package: ``__pycache__``, ``*.pyc``,
    editor backups and locks (``x.py~``, ``.#x.py``, ``x.orig.py``), copies (``x (1).py``)."""
    base = PACKAGE_ROOT / rel
    if base.is_file():
        return [base]
    if not base.is_dir():
        raise ImplementationPartMissing(
            f"implementation part {rel!r}: {base} does not exist; the stage table "
            f"(hyper_parallel/codegen/stage_table.py) names a file or folder the package does not have")
    return sorted(file for file in base.rglob("*.py") if _is_module(file.relative_to(base)))


def _is_module(rel: Path) -> bool:
    """Whether Python would import this file as a module of its folder part: every
    folder on the way and the file's stem are identifiers, and no folder is a bytecode
    cache (``__pycache__`` is an identifier too)."""
    names = (*rel.parent.parts, rel.stem)
    return rel.suffix == ".py" and "__pycache__" not in rel.parent.parts and all(n.isidentifier() for n in names)
