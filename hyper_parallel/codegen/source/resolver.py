"""Find the modeling source of a model without importing transformers.

Two origins:

- ``transformers``: the model_type's modeling file inside the installed transformers
  (``importlib.util.find_spec`` on the top-level package locates it on disk);
- ``remote``: the model folder ships its own code (``auto_map`` in config.json names
  ``AutoModelForCausalLM``, e.g. ``"modeling_fused.FusedForCausalLM"``); the source is
  that file in the model folder, and the other ``*.py`` files beside it (its
  *siblings*, e.g. ``configuration_fused.py``) are recorded with their sha256, because
  the bundle carries copies of them.

Files are read as bytes, so every up-to-date check stays cheap. No absolute path is
recorded: remote files are named relative to the model folder.
"""

import importlib.metadata
import importlib.util
import json
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from hyper_parallel.codegen.hash import sha256_bytes


class SourceError(ValueError):
    """The model's config or modeling source cannot be found or read."""


ORIGIN_TRANSFORMERS = "transformers"
ORIGIN_REMOTE = "remote"
REMOTE_AUTO_CLASS = "AutoModelForCausalLM"
# The bundle generates its own __init__.py; a model folder's one is not a sibling.
NOT_SIBLINGS = frozenset({"__init__.py"})


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
    """(dotted module, absolute path) of the HF modeling file for ``model_type``."""
    name = model_type.replace("-", "_")
    path = transformers_root() / "models" / name / f"modeling_{name}.py"
    if not path.is_file():
        raise SourceError(
            f"unknown model_type {model_type!r}: transformers {transformers_version()} has no "
            f"models/{name}/modeling_{name}.py (a family transformers does not ship can bring its own "
            f"code: put modeling_*.py beside config.json and name its class in "
            f"auto_map.{REMOTE_AUTO_CLASS})")
    return f"transformers.models.{name}.modeling_{name}", path


def resolve_source(model_dir: Path, model_config: dict[str, Any]) -> ModelSource:
    """The model's source: its own remote code when config.json maps
    ``AutoModelForCausalLM`` in ``auto_map``, else transformers' file for its model_type."""
    module = remote_modeling_module(model_config, model_dir / "config.json")
    if module is None:
        return resolve_model_source(model_config["model_type"])
    return resolve_remote_source(model_dir, model_config["model_type"], module)


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


def resolve_remote_source(model_dir: Path, model_type: str, module: str) -> ModelSource:
    path = model_dir / f"{module}.py"
    if not path.is_file():
        raise SourceError(f"{model_dir / 'config.json'}: auto_map.{REMOTE_AUTO_CLASS} names module "
                          f"{module!r}, but {path} does not exist")
    siblings = tuple(
        (sibling.name, sha256_bytes(sibling.read_bytes()))
        for sibling in sorted(model_dir.glob("*.py"))
        if sibling.name != path.name and sibling.name not in NOT_SIBLINGS and sibling.is_file())
    return ModelSource(
        model_type=model_type,
        module=module,
        file=path.name,
        sha256=sha256_bytes(path.read_bytes()),
        transformers_version=transformers_version(),
        origin=ORIGIN_REMOTE,
        siblings=siblings,
    )


def resolve_model_source(model_type: str) -> ModelSource:
    """The transformers modeling file of ``model_type``."""
    module, path = modeling_path(model_type)
    return ModelSource(
        model_type=model_type,
        module=module,
        file=path.relative_to(transformers_root()).as_posix(),
        sha256=sha256_bytes(path.read_bytes()),
        transformers_version=transformers_version(),
    )


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
