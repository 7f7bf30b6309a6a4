"""Find the modeling source of a model without importing transformers.

Two origins:

- ``transformers``: the file inside the installed transformers that defines the causal-LM
  class ``AutoModelForCausalLM.from_config`` builds for the model_type. That is not always
  ``models/<type>/modeling_<type>.py`` (``gemma3_text`` lives in ``gemma3``, ``exaone``
  is ``LlamaForCausalLM``), so it is looked up as transformers' auto classes look it up,
  from transformers' own tables (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
  ``SPECIAL_MODEL_TYPE_TO_MODULE_NAME``) read as literals from its source files, and
  from ``__all__`` in the model packages (``importlib.util.find_spec`` on the top-level
  package locates them on disk; nothing of transformers is imported);
- ``remote``: the model folder ships its own code (``auto_map`` in config.json names
  ``AutoModelForCausalLM``, e.g. ``"modeling_fused.FusedForCausalLM"``); the source is
  that file in the model folder, and the other ``*.py`` files beside it (its
  *siblings*, e.g. ``configuration_fused.py``) are recorded with their sha256, because
  the bundle carries copies of them.

Files are read as bytes, so every up-to-date check stays cheap. No absolute path is
recorded: remote files are named relative to the model folder.
"""

import ast
import importlib.metadata
import importlib.util
import itertools
import json
import re
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

from hyper_parallel.codegen.hash import sha256_bytes
from hyper_parallel.errors import HyperParallelError


class SourceError(ValueError, HyperParallelError):
    """The model's config or modeling source cannot be found or read."""


ORIGIN_TRANSFORMERS = "transformers"
ORIGIN_REMOTE = "remote"
REMOTE_AUTO_CLASS = "AutoModelForCausalLM"
# The bundle generates its own __init__.py; a model folder's one is not a sibling.
NOT_SIBLINGS = frozenset({"__init__.py"})
# transformers' auto tables (read as literals from its source, never imported)
AUTO_DIR = "models/auto"
CAUSAL_LM_TABLE = ("modeling_auto.py", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
# configuration_auto.py imports SPECIAL_MODEL_TYPE_TO_MODULE_NAME from auto_mappings.py and
# updates it: read in that order, as importing them would build it.
MODULE_NAME_FILES = ("auto_mappings.py", "configuration_auto.py")
SPECIAL_NAMES, DEPRECATED = "SPECIAL_MODEL_TYPE_TO_MODULE_NAME", "DEPRECATED_MODELS"
# Files transformers' lazy import structure never exports from (create_import_structure_from_path).
NOT_EXPORTING = ("__init__.py", "convert_", "modular_")
ALL_STATEMENT = re.compile(rb"^__all__\s*=\s*(\[[^\]]*\])", re.M)


@dataclass(frozen=True)
class ModelSource:
    model_type: str
    module: str  # transformers: dotted import path; remote: the module name in the model folder
    file: str  # transformers: relative to the transformers package; remote: relative to the model folder
    sha256: str
    transformers_version: str
    origin: str = ORIGIN_TRANSFORMERS  # ORIGIN_TRANSFORMERS | ORIGIN_REMOTE
    siblings: tuple[tuple[str, str], ...] = ()  # remote: ((file name, sha256), ...) sorted by name

    def identity(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def is_remote(self) -> bool:
        return self.origin == ORIGIN_REMOTE

    @property
    def sibling_modules(self) -> tuple[str, ...]:
        """Module names of the siblings (``configuration_fused`` for ``configuration_fused.py``)."""
        return tuple(name[:-3] for name, _ in self.siblings)

    def display_path(self, model_dir_rel: str) -> str:
        """The source file as a reviewer finds it (diff headers): never absolute."""
        if self.is_remote:
            return f"{model_dir_rel.rstrip('/')}/{self.file}"
        return f"transformers/{self.file}"


@lru_cache(maxsize=None)
def transformers_root() -> Path:
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        raise SourceError("transformers is not installed; install it with `pip install -e .`")
    return Path(list(spec.submodule_search_locations)[0])


@lru_cache(maxsize=None)
def transformers_version() -> str:
    return importlib.metadata.version("transformers")


def read_model_config(model_dir: Path, *, recipe: str, key: str) -> dict[str, Any]:
    """The HF ``config.json`` of ``model_dir`` as a dict (errors name the recipe key)."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise SourceError(f"{recipe}: {key}: no config.json in {model_dir} "
                          f"(expected a local model directory with config.json)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise SourceError(f"{config_path}: malformed JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise SourceError(f"{config_path}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                          f"{recipe}: {key} must point at a folder with a UTF-8 config.json") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise SourceError(f"{config_path}: expected a 'model_type' string, got "
                          f"{config.get('model_type') if isinstance(config, dict) else config!r}")
    return config


def modeling_path(model_type: str) -> tuple[str, Path]:
    """(dotted module, absolute path) of the transformers file that defines the causal-LM
    class ``AutoModelForCausalLM.from_config`` builds for ``model_type``.

    Found as transformers finds it, from its own tables, without importing it (this runs
    in every up-to-date check): the class name from ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
    the package from ``model_type_to_module_name`` (``gemma3_text`` -> ``gemma3``), the
    class in that package, else among all model packages as ``getattribute_from_module``
    falls back to the top level (``exaone`` -> ``LlamaForCausalLM`` in ``llama``)."""
    tables = auto_tables()
    class_name = tables.causal_lm.get(model_type)
    if class_name is None:
        raise SourceError(_no_causal_lm_class(model_type))
    package = tables.module_name(model_type)
    path = _class_in_package(class_name, package) or next(
        filter(None, map(partial(_class_in_package, class_name),
                         _fallback_packages(tables, class_name, package))), None)
    if path is None:
        raise SourceError(f"model_type {model_type!r}: transformers {transformers_version()} maps it to "
                          f"{class_name} ({AUTO_DIR}/{CAUSAL_LM_TABLE[0]} {CAUSAL_LM_TABLE[1]}), but no "
                          f"file under models/ defines class {class_name} and lists it in __all__")
    module = ".".join(("transformers", *path.relative_to(transformers_root()).with_suffix("").parts))
    return module, path


def _no_causal_lm_class(model_type: str) -> str:
    """The refusal for a model_type without a causal-LM class: the historical wording for a
    type transformers does not know at all (it names the file that would be its code)."""
    name = model_type.replace("-", "_")
    conventional = f"models/{name}/modeling_{name}.py"
    if not (transformers_root() / conventional).is_file():
        return (f"unknown model_type {model_type!r}: transformers {transformers_version()} has no "
                f"{conventional} (a family transformers does not ship can bring its own code: put "
                f"modeling_*.py beside config.json and name its class in auto_map.{REMOTE_AUTO_CLASS})")
    return (f"model_type {model_type!r}: transformers {transformers_version()} has {conventional} but maps no "
            f"causal-LM class to it ({AUTO_DIR}/{CAUSAL_LM_TABLE[0]} {CAUSAL_LM_TABLE[1]}); codegen generates "
            f"the class AutoModelForCausalLM builds, so the model must be a causal LM")


@dataclass(frozen=True)
class SourceLocation:
    """Where a model's source is, found without reading its bytes: what the recipe's
    projection knows. Hashing it into a ``ModelSource`` is the resolve stage's work."""

    model_type: str
    module: str  # as ModelSource.module
    file: str  # as ModelSource.file
    path: Path = field(compare=False)  # absolute, for reading only (never in a signature)
    origin: str = ORIGIN_TRANSFORMERS
    sibling_paths: tuple[Path, ...] = field(default=(), compare=False)  # remote: beside the source, sorted

    @property
    def is_remote(self) -> bool:
        return self.origin == ORIGIN_REMOTE

    @property
    def sibling_names(self) -> tuple[str, ...]:
        """The file names of the siblings the bundle carries copies of."""
        return tuple(path.name for path in self.sibling_paths)


def locate_source(model_dir: Path, model_config: dict[str, Any]) -> SourceLocation:
    """Where the model's source is: its own remote code when config.json maps
    ``AutoModelForCausalLM`` in ``auto_map``, else transformers' file for its model_type."""
    module = remote_modeling_module(model_config, model_dir / "config.json")
    if module is None:
        return locate_model_source(model_config["model_type"])
    return locate_remote_source(model_dir, model_config["model_type"], module)


def hash_source(location: SourceLocation) -> ModelSource:
    """The located source with the sha256 of its bytes (and its siblings') and the
    transformers version: the resolve stage's result, what every signature names."""
    siblings = tuple((path.name, sha256_bytes(_read_located(path, location))) for path in location.sibling_paths)
    return ModelSource(
        model_type=location.model_type,
        module=location.module,
        file=location.file,
        sha256=sha256_bytes(_read_located(location.path, location)),
        transformers_version=transformers_version(),
        origin=location.origin,
        siblings=siblings,
    )


def _read_located(path: Path, location: SourceLocation) -> bytes:
    """A located file's bytes; one removed since it was located is named."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise SourceError(f"{path}: missing (located for {location.module}); rerun `doit generate`") from None


def remote_modeling_module(model_config: dict[str, Any], config_path: Path) -> str | None:
    """``modeling_fused`` for ``auto_map: {AutoModelForCausalLM: modeling_fused.FusedForCausalLM}``;
    None when the config maps no causal-LM class to remote code."""
    auto_map = model_config.get("auto_map")
    if auto_map is None:
        return None
    if not isinstance(auto_map, dict):
        raise SourceError(f"{config_path}: auto_map: expected a mapping of auto class to "
                          f"'module.Class', got {auto_map!r}")
    reference = auto_map.get(REMOTE_AUTO_CLASS)
    if reference is None:
        return None
    if not isinstance(reference, str) or "--" in reference:
        # "org/repo--modeling_x.Class" points at code in another Hub repo: not offline, not here
        raise SourceError(f"{config_path}: auto_map.{REMOTE_AUTO_CLASS}: expected 'module.Class' naming a "
                          f"file in the model folder, got {reference!r}")
    module, _, class_name = reference.rpartition(".")
    if not module.isidentifier() or not class_name.isidentifier():
        raise SourceError(f"{config_path}: auto_map.{REMOTE_AUTO_CLASS}: expected 'module.Class' with the "
                          f"module a .py file beside config.json, got {reference!r}")
    return module


def locate_remote_source(model_dir: Path, model_type: str, module: str) -> SourceLocation:
    path = model_dir / f"{module}.py"
    if not path.is_file():
        raise SourceError(f"{model_dir / 'config.json'}: auto_map.{REMOTE_AUTO_CLASS} names module "
                          f"{module!r}, but {path} does not exist")
    siblings = tuple(
        sibling for sibling in sorted(model_dir.glob("*.py"))
        if sibling.name != path.name and sibling.name not in NOT_SIBLINGS and sibling.is_file())
    return SourceLocation(model_type=model_type, module=module, file=path.name, path=path, origin=ORIGIN_REMOTE,
                          sibling_paths=siblings)


def locate_model_source(model_type: str) -> SourceLocation:
    """The transformers modeling file of ``model_type``."""
    module, path = modeling_path(model_type)
    return SourceLocation(model_type=model_type, module=module,
                          file=path.relative_to(transformers_root()).as_posix(), path=path)


def source_text(source: ModelSource, model_dir: Path | None = None) -> str:
    """The modeling source text, checked against the sha256 it was resolved with.
    ``model_dir`` (the recipe's model folder) is needed for remote code."""
    path = _remote_dir(source, model_dir) / source.file if source.is_remote else transformers_root() / source.file
    return _checked_bytes(path, source.sha256, source.module).decode("utf-8")


def sibling_files(source: ModelSource, model_dir: Path | None = None) -> dict[str, bytes]:
    """The remote siblings' bytes by file name, each checked against its recorded sha256
    (empty for a transformers source)."""
    if not source.is_remote:
        return {}
    folder = _remote_dir(source, model_dir)
    return {name: _checked_bytes(folder / name, sha256, source.module) for name, sha256 in source.siblings}


def _remote_dir(source: ModelSource, model_dir: Path | None) -> Path:
    if model_dir is None:
        raise SourceError(f"{source.module}: remote code is read from the model folder; pass model_dir")
    return Path(model_dir)


def _checked_bytes(path: Path, expected: str, module: str) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SourceError(f"{path}: missing (resolved for {module}); rerun `doit generate`") from None
    if sha256_bytes(data) != expected:
        raise SourceError(f"{path}: changed since it was resolved for {module} (expected sha256 "
                          f"{expected}, got {sha256_bytes(data)}); rerun `doit generate`")
    return data


# --- transformers' auto tables, read without importing transformers ----------------------------


@dataclass(frozen=True)
class AutoTables:
    """The parts of transformers' auto machinery that pick a model type's causal-LM class."""

    causal_lm: dict[str, str]  # model_type -> class name
    special_module_names: dict[str, str]  # model_type -> package name where it is not the type itself
    deprecated: frozenset[str]  # packages that live under models/deprecated/

    def module_name(self, model_type: str) -> str:
        """transformers' ``model_type_to_module_name`` (``gpt-sw3`` -> ``gpt_sw3``,
        ``gemma3_text`` -> ``gemma3``, a deprecated one -> ``deprecated.<name>``)."""
        key = self.special_module_names.get(model_type, model_type.replace("-", "_"))
        return f"deprecated.{key}" if key in self.deprecated else key


@lru_cache(maxsize=None)
def auto_tables() -> AutoTables:
    """transformers' causal-LM mapping and module-name tables, from its source files."""
    auto = transformers_root() / AUTO_DIR
    causal_lm = literal_tables(auto / CAUSAL_LM_TABLE[0], {CAUSAL_LM_TABLE[1]}).get(CAUSAL_LM_TABLE[1])
    if not isinstance(causal_lm, dict):
        raise SourceError(f"{auto / CAUSAL_LM_TABLE[0]}: expected a literal {CAUSAL_LM_TABLE[1]} mapping of "
                          f"model_type to class name (transformers {transformers_version()}), found none")
    tables: dict[str, Any] = {}
    for name in MODULE_NAME_FILES:
        tables = literal_tables(auto / name, {SPECIAL_NAMES, DEPRECATED}, tables)
    return AutoTables(causal_lm=causal_lm, special_module_names=dict(tables.get(SPECIAL_NAMES) or {}),
                      deprecated=frozenset(tables.get(DEPRECATED) or ()))


def literal_tables(path: Path, names: Collection[str], tables: dict[str, Any] | None = None) -> dict[str, Any]:
    """The module-level literal tables ``names`` of a Python file, as running it would leave
    them: ``NAME = {...}`` / ``[...]`` / ``OrderedDict([...])`` and ``NAME.update({...})``;
    other statements are skipped. ``tables`` are the names it imported, updated in place."""
    tables = {} if tables is None else tables
    for node in _top_level_statements(path, names):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id in names):
            value = _literal(node.value)
            if value is not None:
                tables[node.targets[0].id] = value
        elif isinstance(node, ast.Expr) and _is_update_call(node.value, tables):
            value = _literal(node.value.args[0])
            if isinstance(value, dict):
                tables[node.value.func.value.id].update(value)
    return tables


def _top_level_statements(path: Path, names: Collection[str]) -> list[ast.stmt]:
    """The file's top-level statements that begin with one of ``names``, parsed alone (the
    auto files are large; parsing all of them would double a no-op generate's resolve), or
    every statement of the file when those pieces do not parse on their own."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SourceError(f"{path}: cannot read transformers' auto tables: {exc}") from None
    starts = b"|".join(re.escape(name.encode()) for name in sorted(names))
    # a statement runs to the next line that starts in column 0 with code (not a closing bracket)
    pieces = re.findall(rb"^(?:" + starts + rb")\b.*?(?=^[^\s)\]}#]|\Z)", data, re.M | re.S)
    try:
        return ast.parse(b"".join(pieces), filename=str(path)).body
    except SyntaxError:
        pass
    try:
        return ast.parse(data, filename=str(path)).body
    except SyntaxError as exc:
        raise SourceError(f"{path}: cannot read transformers' auto tables: {exc}") from None


def _is_update_call(node: ast.expr, tables: dict[str, Any]) -> bool:
    """``NAME.update(one argument)`` on a dict table read before."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
            and isinstance(node.func.value, ast.Name) and isinstance(tables.get(node.func.value.id), dict)
            and len(node.args) == 1 and not node.keywords)


def _literal(node: ast.expr) -> Any:
    """A literal, or ``OrderedDict(literal)`` / ``dict(literal)`` as a dict; None otherwise."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("OrderedDict", "dict"):
        if len(node.args) != 1 or node.keywords:
            return None
        inner = _literal(node.args[0])
        return dict(inner) if isinstance(inner, (dict, list, tuple)) else None
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _fallback_packages(tables: AutoTables, class_name: str, tried: str) -> Iterator[str]:
    """Where transformers' top-level lookup can find a class another package defines: first
    the packages of the other model types mapped to it (``exaone`` -> ``llama``), then every
    model package (the top level exports them all), each once."""
    same_class = (tables.module_name(t) for t, name in tables.causal_lm.items() if name == class_name)
    seen = {tried}
    for package in itertools.chain(same_class, _model_packages()):
        if package not in seen:
            seen.add(package)
            yield package


def _model_packages() -> Iterator[str]:
    """Every package under transformers/models (``llama``, ``deprecated.x``), listed only
    when a lookup gets this far (a generator: the folder walk is the slow part)."""
    models = transformers_root() / "models"
    for init in sorted(models.glob("*/**/__init__.py")):
        yield init.parent.relative_to(models).as_posix().replace("/", ".")


def _class_in_package(class_name: str, package: str) -> Path | None:
    """The file of ``transformers.models.<package>`` that defines ``class_name`` at top level
    and lists it in ``__all__`` (what the package's lazy module resolves the name to)."""
    folder = transformers_root() / "models" / Path(*package.split("."))
    if not folder.is_dir():
        return None
    defines = re.compile(rb"^class " + re.escape(class_name.encode()) + rb"\b", re.M)
    for path in sorted(folder.glob("*.py")):
        if path.name.startswith(NOT_EXPORTING):
            continue
        data = path.read_bytes()
        if defines.search(data) and class_name in exported_names(data):
            return path
    return None


def exported_names(data: bytes) -> list[str]:
    """The file's module-level ``__all__ = [...]``, read as transformers' own
    ``fetch__all__`` reads it (the last such statement, as text, without running the file)."""
    statements = ALL_STATEMENT.findall(data)
    try:
        names = ast.literal_eval(statements[-1].decode("utf-8", "replace")) if statements else []
    except (ValueError, SyntaxError):  # a "]" inside a string cut the statement short
        return []
    return [name for name in names if isinstance(name, str)] if isinstance(names, list) else []
