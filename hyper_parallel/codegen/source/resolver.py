"""Find the HF modeling source of a model without importing transformers.

``importlib.util.find_spec`` on the top-level package locates transformers on disk;
the modeling file is read as bytes. This keeps every up-to-date check cheap.
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


@dataclass(frozen=True)
class ModelSource:
    model_type: str
    module: str  # dotted import path of the HF modeling module
    file: str  # the modeling file, relative to the transformers package
    sha256: str
    transformers_version: str

    def identity(self) -> dict[str, Any]:
        return asdict(self)


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
            f"models/{name}/modeling_{name}.py")
    return f"transformers.models.{name}.modeling_{name}", path


def resolve_model_source(model_type: str) -> ModelSource:
    module, path = modeling_path(model_type)
    return ModelSource(
        model_type=model_type,
        module=module,
        file=path.relative_to(transformers_root()).as_posix(),
        sha256=sha256_bytes(path.read_bytes()),
        transformers_version=transformers_version(),
    )


def source_text(source: ModelSource) -> str:
    """The modeling source text, checked against the sha256 it was resolved with."""
    data = (transformers_root() / source.file).read_bytes()
    if sha256_bytes(data) != source.sha256:
        raise SourceError(f"{source.module}: modeling source changed since it was resolved "
                          f"(expected sha256 {source.sha256}, got {sha256_bytes(data)}); rerun `doit generate`")
    return data.decode("utf-8")
