"""Every exception class the package defines has the common base ``HyperParallelError``
(and keeps its builtin one), so one ``except`` catches what the project raises.

Two checks: one reads the source (fast, sees classes anywhere, even in a function
body) and one imports every module and inspects the classes themselves (slow: it
imports all of transformers' model code the package touches)."""

import ast
import builtins
import functools
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import hyper_parallel
from hyper_parallel.errors import HyperParallelError

PACKAGE_DIR = Path(hyper_parallel.__file__).parent
COMMON_BASE = HyperParallelError.__name__


# --- from the source ------------------------------------------------------------------------------


def _source_classes() -> dict[str, list[tuple[str, set[str]]]]:
    """Class name -> ``(where, names of its bases)`` for every class in the package's source."""
    found: dict[str, list[tuple[str, set[str]]]] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                bases = {base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                         for base in node.bases}
                found.setdefault(node.name, []).append((f"{path.relative_to(PACKAGE_DIR)}:{node.lineno}", bases))
    return found


def test_every_exception_in_the_source_has_the_common_base():
    classes = _source_classes()

    @functools.cache
    def derives(name: str, target) -> bool:
        if target(name):
            return True
        return any(derives(base, target) for _, bases in classes.get(name, ()) for base in bases if base != name)

    def builtin_exception(name: str) -> bool:
        found = getattr(builtins, name, None)
        return inspect.isclass(found) and issubclass(found, BaseException)

    offenders = [where for name, definitions in classes.items() for where, bases in definitions
                 if any(derives(base, builtin_exception) for base in bases)
                 and not any(derives(base, lambda n: n == COMMON_BASE) for base in bases)
                 and name != COMMON_BASE]
    assert len([name for name in classes if derives(name, builtin_exception)]) >= 25  # the walk saw them
    assert offenders == [], f"add {COMMON_BASE} (hyper_parallel.errors) as a base, after the builtin one"


def test_errors_is_a_leaf():
    tree = ast.parse((PACKAGE_DIR / "errors.py").read_text())
    assert not [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


# --- from the classes themselves ------------------------------------------------------------------


def _package_modules():
    """Every module of the package, imported; entry points (``__main__``) run on import,
    and the source check above covers their classes."""
    for info in pkgutil.walk_packages(hyper_parallel.__path__, "hyper_parallel."):
        if not info.name.endswith(".__main__"):
            yield importlib.import_module(info.name)


def _classes_in(module) -> set[type]:
    """Classes defined in ``module``, nested ones (in class bodies) included."""
    found: set[type] = set()
    pending = [module]
    while pending:
        namespace = pending.pop()
        for obj in list(vars(namespace).values()):
            if inspect.isclass(obj) and obj.__module__ == module.__name__ and obj not in found:
                found.add(obj)
                pending.append(obj)
    return found


@functools.cache
def _package_exceptions() -> tuple[type, ...]:
    found = {cls for module in _package_modules() for cls in _classes_in(module) if issubclass(cls, BaseException)}
    return tuple(sorted(found, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}"))


@pytest.mark.slow
def test_every_package_exception_has_the_common_base():
    found = _package_exceptions()
    assert len(found) >= 25  # the walk reached the package (31 classes when this was written)
    missing = [f"{cls.__module__}.{cls.__qualname__}" for cls in found if not issubclass(cls, HyperParallelError)]
    assert missing == [], f"add {COMMON_BASE} (hyper_parallel.errors) as a base, after the builtin one"


@pytest.mark.slow
def test_builtin_bases_are_kept():
    found = {cls.__name__: cls for cls in _package_exceptions()}
    for name, builtin in (("RecipeError", ValueError), ("PlanError", ValueError), ("BundleError", OSError),
                          ("CodegenWaitError", TimeoutError), ("BundleImportError", ImportError),
                          ("StageError", RuntimeError), ("StageRecordError", FileNotFoundError),
                          ("ContextParallelError", ValueError), ("Unsliceable", TypeError),
                          ("PreflightError", RuntimeError), ("StyleRefusal", ValueError)):
        assert issubclass(found[name], builtin) and issubclass(found[name], HyperParallelError), name


USER_FACING = ("codegen/stages.py", "trainer", "config")  # what a user's command runs through
BUILTIN_RAISE = re.compile(r"\braise (RuntimeError|ValueError|FileNotFoundError|KeyError|TypeError|OSError)\(")


def test_user_facing_code_raises_the_project_s_errors_not_builtins():
    """The stages, the trainer and the config layer raise only the project's errors (each
    keeps its builtin base), so a front door tells the user's fault from ours by class."""
    package = Path(hyper_parallel.__file__).parent
    found = []
    for entry in USER_FACING:
        root = package / entry
        for path in sorted([root] if root.is_file() else root.rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                if BUILTIN_RAISE.search(line):
                    found.append(f"{path.relative_to(package)}:{number}: {line.strip()}")
    assert not found, "raise a HyperParallelError subclass instead:\n" + "\n".join(found)
