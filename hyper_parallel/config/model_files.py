"""Where a recipe's model lives and which weight files it has: one answer for codegen,
the model builder, the trainer and the reference run.

``model.pretrained_model_name_or_path`` is a folder (relative to the recipe's folder, or
absolute) or, when no such folder exists, a Hugging Face Hub id (``Qwen/Qwen3-0.6B``)
found in the local Hub cache; nothing is downloaded (offline clusters work the same).
Weights are what ``from_pretrained`` reads: ``*.safetensors`` (one file, or shards with
their index) or ``pytorch_model*.bin``. Importing this module imports neither torch nor
transformers (up-to-date checks use it)."""

import os
import re
from dataclasses import dataclass
from pathlib import Path

from hyper_parallel.config.schema import TrainerConfig
from hyper_parallel.errors import HyperParallelError

WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
LOOKED_FOR = "*.safetensors (one file, or shards with model.safetensors.index.json) or pytorch_model*.bin"
HUB_PREFIX = "hf://"
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


class ModelLocationError(ValueError, HyperParallelError):
    """The recipe's model is neither a folder nor in the Hub cache; says how to get it."""


@dataclass(frozen=True)
class ModelLocation:
    folder: Path  # absolute; may not exist (then readers say "no config.json in <folder>")
    display: str  # what signatures and messages record: the path relative to the recipe, or hf://<id>


def model_location(config: TrainerConfig) -> ModelLocation:
    """The recipe's model folder: the path as written, else a Hub id's cached snapshot."""
    raw = config.model.pretrained_model_name_or_path
    yaml_dir = config.folder
    folder = Path(os.path.abspath(yaml_dir / raw))
    if folder.exists() or not _HUB_ID.fullmatch(raw):
        return ModelLocation(folder.resolve(), os.path.relpath(folder.resolve(), yaml_dir).replace(os.sep, "/"))
    cached = _hub_snapshot(raw)
    if cached is None:
        raise ModelLocationError(
            f"{config.where}: model.pretrained_model_name_or_path: no config.json in {folder} "
            f"(no such folder), and no model {raw} in the local Hugging Face cache ({_hub_cache()}); download it "
            f"with `hf download {raw}` (or `huggingface-cli download {raw}`), or write the model folder's path")
    return ModelLocation(cached, f"{HUB_PREFIX}{raw}")


def _hub_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot of ``repo_id`` (its ``main`` revision), without network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True)).resolve()
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def _hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def checkpoint_files(folder: Path) -> list[Path]:
    """The weight files ``from_pretrained`` would read from ``folder``, in name order."""
    return sorted({path for pattern in WEIGHT_GLOBS for path in folder.glob(pattern) if path.is_file()})


def has_safetensors(folder: Path) -> bool:
    """Whether the weights are safetensors (the per-rank sharded loader reads only those)."""
    return any(path.suffix == ".safetensors" for path in checkpoint_files(folder))
