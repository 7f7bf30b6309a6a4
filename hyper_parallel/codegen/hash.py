"""Hashing helpers shared by signatures, meta and preflight. No torch imports here."""

import hashlib
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from hyper_parallel.digest import sha256_bytes, sha256_file  # noqa: F401 (the codegen side's names)
from hyper_parallel.errors import HyperParallelError

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # .../hyper_parallel


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


# ``from hyper_parallel.x import a, b`` (parenthesized over lines too) and ``import hyper_parallel.x``.
_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(hyper_parallel(?:\.\w+)*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]+)"
                     r"|import[ \t]+(hyper_parallel(?:\.\w+)*))", re.MULTILINE)


@lru_cache(maxsize=None)
def runner_parts(runner: str, dynamic: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The package files a stage's runner (``module:function``) can run, relative to
    ``hyper_parallel/``: its module, what that module imports at its top level, what the
    function imports, and so on through every module reached (any import in them counts:
    a function-level import is code the module may run). ``dynamic``: parts imported by
    computed names (a recipe's ``replace_module`` target), which no import statement shows.
    Read with a regular expression, not by importing or parsing: an up-to-date check pays
    for it."""
    module, _, function = runner.partition(":")
    file = _module_file(module)
    functions = _top_level_functions(file.read_text(encoding="utf-8")) if file else {}
    if function not in functions:
        raise ImplementationPartMissing(f"stage runner {runner!r}: no function {function!r} in "
                                        f"{file or module}; the stage table (hyper_parallel/codegen/stage_table.py) "
                                        f"names a runner the package does not have")
    top_level = "\n".join(line for line in file.read_text(encoding="utf-8").splitlines()
                          if line.startswith(("from ", "import ")))
    # The runner's own module is read as above (its top level and the functions the runner
    # reaches), never whole, however the closure comes back to it (the table names it).
    files = {file, *_closure(_imported(top_level) | _imported(_reached_bodies(functions, function)), file)}
    files |= {f for part in dynamic for f in part_modules(part)}
    return tuple(sorted(f.relative_to(PACKAGE_ROOT).as_posix() for f in files))


def _top_level_functions(text: str) -> dict[str, str]:
    """The module's top-level functions by name: their source text."""
    return {match.group(1): match.group(0)
            for match in re.finditer(r"^def (\w+)\(.*?(?=^\S|\Z)", text, re.MULTILINE | re.DOTALL)}


def _reached_bodies(functions: dict[str, str], start: str) -> str:
    """The text of ``start`` and of the module's own functions it calls, in turn (a runner
    delegates to helpers beside it, whose imports are its code too)."""
    reached, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += [other for other in functions if re.search(rf"\b{other}\(", functions[name])]
    return "\n".join(functions[name] for name in sorted(reached))


# A module named in a string (``torchrun -m hyper_parallel.codegen.check.verify_worker``): run, so counted.
_MODULE_STRING = re.compile(r"""["'](hyper_parallel(?:\.\w+)+)["']""")


def _imported(text: str) -> set[str]:
    """The package modules (and the names that may be submodules) ``text`` imports or
    names as a module to run."""
    found = set(_MODULE_STRING.findall(text))
    for match in _IMPORT.finditer(text):
        module = match.group(1) or match.group(3)
        found.add(module)
        for item in re.split(r"[,\s()]+", match.group(2) or ""):
            if item.isidentifier() and item != "as":
                found.add(f"{module}.{item}")
    return found


def _closure(names: set[str], runner_file: Path) -> set[Path]:
    """The files of the modules ``names`` denote, and of every module they import in turn
    (a package's ``__init__`` runs on the way to its modules), ``runner_file`` excepted."""
    seen: set[Path] = set()
    visited: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in visited:
            continue
        visited.add(name)
        parts = name.split(".")
        for end in range(2, len(parts) + 1):
            file = _module_file(".".join(parts[:end]))
            if file is not None and file not in seen and file != runner_file:
                seen.add(file)
                todo.extend(_file_imports(file))
    return seen


@lru_cache(maxsize=None)
def _file_imports(file: Path) -> frozenset[str]:
    """What one module imports, read once per process (stages share most modules)."""
    return frozenset(_imported(file.read_text(encoding="utf-8")))


@lru_cache(maxsize=None)
def _module_file(name: str) -> Path | None:
    """The file of package module ``name`` (a module or a package's ``__init__``); None for
    a name that is not one (an imported function or class)."""
    base = PACKAGE_ROOT.joinpath(*name.split(".")[1:])
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return base / "__init__.py" if (base / "__init__.py").is_file() else None
