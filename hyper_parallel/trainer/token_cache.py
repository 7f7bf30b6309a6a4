"""Tokenize once: the packed token rows of a dataset, kept on disk and memory-mapped.

A cache entry is a folder ``<cache>/<key>/`` holding ``rows.bin`` (the packed rows, int32,
``[rows, seq_len]`` in C order) and ``index.json`` (their count, the documents and tokens
they came from, the largest token id, and the rows' sha256: the fingerprint a checkpoint
records, the same as before there was a cache). The key is the sha256 of everything the
rows depend on: the data files' contents (sha256, not their dates), the tokenizer's
files, the dataset keys that decide what a document is, ``seq_len`` and this format's
version, so a changed file, tokenizer or packing setting is a new entry and an entry is
never stale. An entry is written into a temporary sibling folder and renamed in whole.

Training memory-maps ``rows.bin``: a rank's memory holds the rows it reads, not the
corpus, and a second start reads no text (``python -m hyper_parallel.trainer prepare-data``
fills the cache ahead of a run). The cache lives in the workspace (``generated/tokens``,
``$HYPER_PARALLEL_WORKSPACE``), or at ``dataset.cache_dir``.
"""

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hyper_parallel.config.schema import DatasetConfig
from hyper_parallel.config.workspace import default_workspace_root

FORMAT = 1
ROWS_FILE, INDEX_FILE = "rows.bin", "index.json"
# The model folder's files a tokenizer is read from (AutoTokenizer's, by name).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json")
_HASH_CHUNK = 1 << 22


def cache_root(dataset: DatasetConfig, where: str) -> Path:
    """``dataset.cache_dir`` (relative to the recipe's folder), else the workspace's ``tokens``."""
    if dataset.cache_dir:
        path = Path(dataset.cache_dir)
        return path if path.is_absolute() else Path(where).parent / path
    return default_workspace_root() / "tokens"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def cache_key(dataset: DatasetConfig, seq_len: int, files: list[Path], model_dir: Path) -> str:
    """The sha256 of what the packed rows depend on (see the module docstring)."""
    tokenizer = {name: file_sha256(model_dir / name) for name in TOKENIZER_FILES if (model_dir / name).is_file()}
    inputs = {"format": FORMAT, "kind": dataset.kind, "text_column": dataset.text_column,
              "sample_by": dataset.sample_by, "seq_len": seq_len,
              "files": [file_sha256(path) for path in files], "tokenizer": tokenizer}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def load_entry(folder: Path) -> tuple[torch.Tensor, dict[str, Any]] | None:
    """The entry's rows, memory-mapped (copy on write: nothing is written back), and its
    index; None where there is no complete entry."""
    try:
        index = json.loads((folder / INDEX_FILE).read_text())
    except (OSError, ValueError):
        return None
    if index.get("format") != FORMAT:
        return None
    shape = (int(index["rows"]), int(index["seq_len"]))
    if (folder / ROWS_FILE).stat().st_size != shape[0] * shape[1] * 4:
        return None
    if shape[0] == 0:  # too little text for one row (an empty file cannot be mapped)
        return torch.empty(shape, dtype=torch.int32), index
    mapped = np.memmap(folder / ROWS_FILE, dtype=np.int32, mode="c", shape=shape)
    return torch.from_numpy(mapped), index


def write_entry(folder: Path, rows: torch.Tensor, index: dict[str, Any]) -> None:
    """Write ``rows`` and ``index`` as the entry ``folder``, whole or not at all (another
    process writing the same entry at once is harmless: the same bytes, one rename wins)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.parent / f".{folder.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        rows.contiguous().numpy().astype(np.int32, copy=False).tofile(staging / ROWS_FILE)
        (staging / INDEX_FILE).write_text(json.dumps({"format": FORMAT, **index}, indent=1, sort_keys=True))
        try:
            staging.rename(folder)
        except OSError:
            if load_entry(folder) is None:  # not another writer's complete entry
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
