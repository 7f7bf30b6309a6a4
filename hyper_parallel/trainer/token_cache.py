"""Tokenize once: the packed token rows of a dataset, kept on disk and memory-mapped.

A cache entry is a folder ``<cache>/<key>/`` holding ``rows.bin`` (the packed rows, int32,
``[rows, seq_len]`` in C order) and ``index.json`` (their count, the documents and tokens
they came from, the largest token id, and the rows' sha256: the fingerprint a checkpoint
records, the same as before there was a cache). The key is the sha256 of everything the
rows depend on: the data files' contents (sha256, not their dates), the tokenizer's
files, the dataset keys that decide what a document is, ``seq_len`` and this format's
version, so a changed file, tokenizer or packing setting is a new entry and an entry is
never stale (a file's sha256 is remembered with its size, time and inode: an unchanged file
is not read again). An entry is written as it is tokenized, into a temporary sibling
folder, and renamed in whole.

Training memory-maps ``rows.bin``: a rank's memory holds the rows it reads, not the
corpus, and a second start reads no text (``python -m hyper_parallel.trainer prepare-data``
fills the cache ahead of a run). The cache lives in the workspace (``generated/tokens``,
``$HYPER_PARALLEL_WORKSPACE``), or at ``dataset.cache_dir``.
"""

import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hyper_parallel.config.schema import DatasetConfig
from hyper_parallel.config.workspace import default_workspace_root
from hyper_parallel.trainer.data import DataError

FORMAT = 1
ROWS_FILE, INDEX_FILE, HASHES_FILE = "rows.bin", "index.json", "file_hashes.json"
# The model folder's files a tokenizer is read from (AutoTokenizer's, by name).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json")
_HASH_CHUNK = 1 << 22
RACY_NS = 2_000_000_000
ABANDONED_S = 600.0


def cache_root(dataset: DatasetConfig, where: str) -> Path:
    """``dataset.cache_dir`` (relative to the recipe's folder), else the workspace's ``tokens``."""
    if dataset.cache_dir:
        path = Path(dataset.cache_dir)
        path = path if path.is_absolute() else Path(where).parent / path
    else:
        path = default_workspace_root() / "tokens"
    if path.exists() and not path.is_dir():
        raise DataError(f"{where}: dataset.cache_dir: {path} is a file; expected a folder for the token cache "
                        f"(relative paths start at the recipe's folder); fix dataset.cache_dir")
    return path


def remove_abandoned(root: Path) -> list[Path]:
    """Staging folders of writers that died (a SIGKILL, a node lost: no ``finally`` ran),
    told by age: a live writer appends to its rows file all the time, so a staging folder
    nothing was written into for ``ABANDONED_S`` is removed. Returns what was removed."""
    removed = []
    for folder in root.glob(".*-*-*") if root.is_dir() else ():
        try:
            newest = max([folder.stat().st_mtime, *(f.stat().st_mtime for f in folder.iterdir())])
        except OSError:  # removed or renamed meanwhile by its writer
            continue
        if folder.is_dir() and time.time() - newest > ABANDONED_S:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class KnownHashes:
    """The data files' sha256, remembered in ``<cache>/file_hashes.json`` by path with the
    file's size, modification and status-change times (ns) and inode: a start on unchanged
    files reads none of their bytes (hashing costs seconds per GB, on every rank). A file
    written since has another size or time and is hashed again: git's rule (the status-change
    time cannot be set back: ``cp -p`` or ``touch -r`` over a file keep its mtime, not it). A file
    changed in the last two seconds is not remembered (git's "racy" rule: a write in the
    same clock tick could keep size and times)."""

    def __init__(self, root: Path):
        self.path = root / HASHES_FILE
        try:
            self.known = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.known = {}
        self.changed = False

    def sha256(self, file: Path) -> str:
        stat = file.stat()
        stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
        key = str(file.resolve())
        seen = self.known.get(key)
        if isinstance(seen, list) and len(seen) == 5 and seen[:4] == stamp:
            return seen[4]
        digest = file_sha256(file)
        if time.time_ns() - max(stat.st_mtime_ns, stat.st_ctime_ns) > RACY_NS:
            self.known[key], self.changed = [*stamp, digest], True
        return digest

    def save(self) -> None:
        """Written by rename (ranks that write at once each leave a whole file); a cache
        folder that cannot be written only costs the next start its hashing."""
        if not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            staging = self.path.with_name(f".{HASHES_FILE}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            staging.write_text(json.dumps(self.known, indent=1, sort_keys=True))
            staging.replace(self.path)
        except OSError:
            pass


def cache_key(dataset: DatasetConfig, seq_len: int, files: list[Path], model_dir: Path, root: Path) -> str:
    """The sha256 of what the packed rows depend on (see the module docstring); the data
    files' hashes remembered under ``root`` (``KnownHashes``)."""
    hashes = KnownHashes(root)
    tokenizer = {name: file_sha256(model_dir / name) for name in TOKENIZER_FILES if (model_dir / name).is_file()}
    inputs = {"format": FORMAT, "kind": dataset.kind, "text_column": dataset.text_column,
              "sample_by": dataset.sample_by, "seq_len": seq_len,
              "files": [hashes.sha256(path) for path in files], "tokenizer": tokenizer}
    hashes.save()
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


class EntryWriter:
    """Writes an entry as its tokens come: appended to ``rows.bin`` in a temporary sibling
    folder, the rows' sha256 and largest id taken as whole rows complete (the tail that fills
    no row is cut off at the end), then renamed into place whole. Memory holds one batch and
    less than a row, whatever the corpus' size. A failure leaves no entry (``with``)."""

    def __init__(self, folder: Path, seq_len: int):
        self.folder, self.seq_len = folder, seq_len
        folder.parent.mkdir(parents=True, exist_ok=True)
        self.staging = folder.parent / f".{folder.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.staging.mkdir()
        self.file = open(self.staging / ROWS_FILE, "wb")
        self.digest = hashlib.sha256()
        self.tail = np.empty(0, dtype=np.int32)  # tokens after the last complete row
        self.tokens = self.rows = 0
        self.max_token = -1

    def __enter__(self) -> "EntryWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self.file.close()
        shutil.rmtree(self.staging, ignore_errors=True)

    def append(self, tokens: np.ndarray) -> None:
        """The next tokens of the stream (int32)."""
        self.file.write(tokens.tobytes())
        self.tokens += tokens.size
        pending = np.concatenate([self.tail, tokens])
        whole = pending.size // self.seq_len * self.seq_len
        if whole:
            self.digest.update(pending[:whole].tobytes())
            self.max_token = max(self.max_token, int(pending[:whole].max()))
            self.rows += whole // self.seq_len
        self.tail = pending[whole:]

    def commit(self, documents: int) -> None:
        """The rows cut to whole ones, the index written, the entry renamed into place
        (another process writing the same entry at once is harmless: the same bytes, one
        rename wins)."""
        self.file.truncate(self.rows * self.seq_len * 4)
        self.file.close()
        index = {"format": FORMAT, "rows": self.rows, "seq_len": self.seq_len, "documents": documents,
                 "tokens": self.tokens, "max_token": self.max_token, "fingerprint": self.digest.hexdigest()}
        (self.staging / INDEX_FILE).write_text(json.dumps(index, indent=1, sort_keys=True))
        try:
            self.staging.rename(self.folder)
        except OSError:
            if load_entry(self.folder) is not None:  # another writer's complete entry: the same bytes
                return
            shutil.rmtree(self.folder, ignore_errors=True)  # a damaged entry (a file lost or cut short)
            self.staging.rename(self.folder)
