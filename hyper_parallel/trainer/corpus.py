"""Real training data: local plain text, JSON lines or parquet files read with HF
``datasets`` (local files only, streamed: no Arrow copy is cached, only its lock files are
written to its cache folder), tokenized with the tokenizer in the model folder, and packed.

Packing: the documents, in file order, each followed by the tokenizer's EOS token, form one
token stream; it is cut into rows of ``seq_len`` tokens (the tail that fills no row is
dropped). A step takes ``global_batch_size`` rows at the data position (rows consumed so
far), the same on every rank; trainer/data.py's ``micro_batches`` then gives each dp rank
its own contiguous slice, so the dp ranks' rows are disjoint and together the whole batch.
With ``shuffle`` the rows of each epoch come in a permutation seeded by
``training.seed`` and the epoch. The position is a row count, saved in each checkpoint, so a
resumed run continues at the row where the checkpoint stopped.

The packed rows are tokenized once and kept in the token cache (trainer/token_cache.py),
keyed by the files' contents, the tokenizer and the settings; training memory-maps them.
Under torchrun each node's local rank 0 prepares a missing entry before the model is built,
the node's other ranks wait for it, and the rows are a pure function of the files and the
tokenizer, so every node's entry holds the same rows (their fingerprints are compared). An
error (missing file, no tokenizer, empty dataset, missing column) reaches every rank, is
said once by rank 0 (``hyper_parallel.trainer.__main__``), and every rank exits with 2.
"""

import hashlib
import itertools
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hyper_parallel.config.schema import DatasetConfig, TrainingConfig
from hyper_parallel.trainer.data import DataError, existing_dataset_path
from hyper_parallel.trainer.token_cache import cache_key, cache_root, load_entry, write_entry

_LOG = logging.getLogger(__name__)

# The files a folder path contributes, per kind (``datasets`` reads each file by its kind,
# whatever its name; these only choose which files of a folder are data).
SUFFIXES = {"text": (".txt", ".text"), "jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}
BUILDERS = {"text": "text", "jsonl": "json", "parquet": "parquet"}  # datasets' packaged builder per kind
_TOKENIZE_BATCH = 1000  # documents per tokenizer call (the fast tokenizer batches them in Rust)
_PROGRESS_EVERY_S = 5.0
PREPARE_TIMEOUT_S = 3600.0  # how long a rank waits for its node's local rank 0 to tokenize the corpus


@dataclass
class PackedCorpus:
    """The packed token rows of a dataset and what identifies them in a checkpoint."""

    rows: torch.Tensor  # [rows, seq_len], int32 (half of int64's memory); memory-mapped from the cache
    documents: int
    fingerprint: str  # sha256 of the rows' bytes: a resumed run checks it trains on the same data
    max_token: int = -1  # the largest token id (read once, when the rows were packed)
    ids: torch.Tensor | None = None  # the rows this corpus trains on (None: all; training.eval holds some out)
    cache: Path | None = None  # the cache entry the rows are mapped from

    @property
    def num_rows(self) -> int:
        """Packed sequences: the length of one epoch, in rows."""
        return self.rows.shape[0] if self.ids is None else self.ids.numel()

    def take(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of this corpus as int64 token ids (only those rows are read)."""
        return self.rows[index if self.ids is None else self.ids[index]].long()


def dataset_files(dataset: DatasetConfig, where: str) -> list[Path]:
    """The dataset's files: ``dataset.path`` itself, or a folder's files of the kind's
    suffixes in name order. Relative paths start at the recipe's folder."""
    path = existing_dataset_path(dataset, where)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"{where}: dataset.path: {path} is neither a file nor a folder; expected local "
                        f"{dataset.kind} data")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.lower().endswith(SUFFIXES[dataset.kind]))
    if not files:
        raise DataError(f"{where}: dataset.path: the folder {path} holds no {dataset.kind} file (names ending in "
                        f"{', '.join(SUFFIXES[dataset.kind])}); fix dataset.path or dataset.kind")
    return files


def load_tokenizer(model_dir: Path, where: str, kind: str):
    """The model folder's tokenizer (``AutoTokenizer``, local files only). Named errors:
    no tokenizer there, one that does not load, or one without an EOS token (it separates
    the packed documents)."""
    from transformers import AutoTokenizer  # the trainer has transformers loaded already

    key = "model.pretrained_model_name_or_path"
    fix = (f"save the model's tokenizer into that folder (tokenizer.save_pretrained('{model_dir}')), or use "
           f"dataset.kind: bytes or synthetic")
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                        "tokenizer.model", "vocab.json", "vocab.txt")):
        raise DataError(f"{where}: {key}: {model_dir} has no tokenizer (no tokenizer.json or "
                        f"tokenizer_config.json), which dataset.kind {kind!r} needs; fix: {fix}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{where}: {key}: the tokenizer in {model_dir} cannot be loaded ({first}); fix: {fix}") \
            from None
    if tokenizer.eos_token_id is None:
        raise DataError(f"{where}: {key}: the tokenizer in {model_dir} has no eos_token, which separates the "
                        f"packed documents; fix: set eos_token in its tokenizer_config.json")
    return tokenizer


def _import_datasets(kind: str, where: str):
    """HF ``datasets``, imported only when a recipe reads real data (it is heavy, and an
    optional dependency: ``pip install -e ".[data]"``). Offline: the data are local files."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise DataError(f"{where}: dataset.kind: {kind!r} reads its files with HF datasets, which is not "
                        f"installed; fix: pip install -c constraints.txt -e \".[data]\" (in the project's "
                        f"checkout)") from None
    datasets.logging.set_verbosity_error()  # its own progress bars and notes would repeat on every rank
    datasets.disable_progress_bars()
    return datasets


def iter_documents(dataset: DatasetConfig, files: list[Path], where: str) -> Iterator[str]:
    """Each document's text, in file order then row order (``datasets`` streaming: rows
    are read as they are tokenized, no Arrow copy is made). Empty documents are skipped."""
    datasets = _import_datasets(dataset.kind, where)
    options = {"sample_by": dataset.sample_by} if dataset.kind == "text" else {}
    column = "text" if dataset.kind == "text" else dataset.text_column
    for file in files:
        try:
            stream = datasets.load_dataset(BUILDERS[dataset.kind], data_files=[str(file)], split="train",
                                           streaming=True, **options)
            index = 0
            for rows in stream.iter(batch_size=_TOKENIZE_BATCH):  # a column's values at a time: cheaper than rows
                if column not in rows:
                    raise DataError(f"{where}: dataset.text_column: {file} has no column {column!r} (its columns: "
                                    f"{', '.join(sorted(rows)) or 'none'}); fix dataset.text_column")
                for text in rows[column]:
                    if text is not None and not isinstance(text, str):
                        raise DataError(f"{where}: dataset.text_column: {file} row {index}: {column!r} holds "
                                        f"{type(text).__name__}, expected text; fix dataset.text_column")
                    index += 1
                    if text:
                        yield text
        except DataError:
            raise
        except StopIteration:  # datasets' json reader on an empty file
            continue
        except Exception as exc:  # noqa: BLE001 -- a reader's error is the user's file, named in one line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DataError(f"{where}: dataset.path: {file} cannot be read as {dataset.kind} ({first[:300]}); "
                            f"fix the file or dataset.kind") from None


def token_stream(documents: Iterator[str], tokenizer, log: bool) -> tuple[torch.Tensor, int]:
    """The documents' tokens, each document followed by EOS, as one int32 tensor; and the
    number of documents. Logs progress every few seconds when ``log``."""
    eos = tokenizer.eos_token_id
    chunks: list[torch.Tensor] = []
    count, tokens, started, last = 0, 0, time.monotonic(), time.monotonic()
    batch: list[str] = []

    def flush() -> None:
        """Tokenize the pending documents in one call (the fast tokenizer batches them)."""
        nonlocal tokens
        ids = tokenizer(batch, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        flat = np.fromiter(itertools.chain.from_iterable(doc + [eos] for doc in ids), dtype=np.int32)
        chunks.append(torch.from_numpy(flat))
        tokens += flat.size
        batch.clear()

    for text in documents:
        batch.append(text)
        count += 1
        if len(batch) == _TOKENIZE_BATCH:
            flush()
            if log and time.monotonic() - last > _PROGRESS_EVERY_S:
                last = time.monotonic()
                _LOG.info(f"dataset: {count:,} documents, {tokens:,} tokens tokenized "
                          f"({last - started:.0f}s)")
    if batch:
        flush()
    return (torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.int32)), count


def pack(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The stream cut into ``[rows, seq_len]`` (the partial last row dropped)."""
    rows = stream.numel() // seq_len
    return stream[:rows * seq_len].view(rows, seq_len)


def prepare_corpus(dataset: DatasetConfig, training: TrainingConfig, model_dir: Path, where: str,
                   log: bool = True, prepare: bool = True) -> PackedCorpus | None:
    """The recipe's dataset as packed rows, memory-mapped from the token cache
    (trainer/token_cache.py): read from there when an entry for these files, tokenizer and
    settings exists, else (``prepare``) read, tokenized, packed and written there first;
    None where it must be prepared and ``prepare`` is off (another rank prepares it).
    Enough rows for one step, else a named error."""
    files = dataset_files(dataset, where)
    key = cache_key(dataset, training.seq_len, files, model_dir)
    folder = cache_root(dataset, where) / key
    shown = _shown(files)
    entry = load_entry(folder)
    if entry is None and not prepare:
        return None
    how = f"from the token cache {folder}"
    if entry is None:
        seconds = _write_prepared(dataset, training, model_dir, where, files, folder, log)
        entry, how = load_entry(folder), f"tokenized in {seconds:.1f}s, cached in {folder}"
    rows, index = entry
    if log:
        _LOG.info(f"dataset: {index['documents']:,} documents, {index['tokens']:,} tokens, {rows.shape[0]:,} "
                  f"sequences of {training.seq_len} ({how})")
    if rows.shape[0] < training.global_batch_size:
        raise DataError(f"{where}: dataset.path: {shown} packs into {rows.shape[0]} sequence(s) of seq_len "
                        f"{training.seq_len} ({index['tokens']:,} tokens from {index['documents']} documents), one "
                        f"step needs training.global_batch_size = {training.global_batch_size}; use more data or "
                        f"smaller training sizes")
    return PackedCorpus(rows, index["documents"], index["fingerprint"], index["max_token"], cache=folder)


def _write_prepared(dataset: DatasetConfig, training: TrainingConfig, model_dir: Path, where: str, files: list[Path],
                    folder: Path, log: bool) -> float:
    """Read, tokenize and pack the dataset; write it as the cache entry ``folder``; the
    seconds it took."""
    tokenizer = load_tokenizer(model_dir, where, dataset.kind)
    started = time.monotonic()
    if log:
        _LOG.info(f"dataset: reading {len(files)} {dataset.kind} file(s) from {dataset.path}, tokenizing with "
                  f"{model_dir}")
    stream, documents = token_stream(iter_documents(dataset, files, where), tokenizer, log)
    if documents == 0:
        raise DataError(f"{where}: dataset.path: {_shown(files)} holds no documents (every {_unit(dataset)} is empty); "
                        f"fix dataset.path")
    rows = pack(stream, training.seq_len)
    index = {"rows": rows.shape[0], "seq_len": training.seq_len, "documents": documents, "tokens": stream.numel(),
             "max_token": int(rows.max()) if rows.numel() else -1,
             "fingerprint": hashlib.sha256(rows.numpy().tobytes()).hexdigest()}
    write_entry(folder, rows, index)
    return time.monotonic() - started


def prepare_corpus_on_every_node(dataset: DatasetConfig, training: TrainingConfig, model_dir: Path, where: str,
                                 log: bool = True) -> PackedCorpus:
    """``prepare_corpus`` under torchrun: on each node the local rank 0 prepares a missing
    cache entry (its own disk: no shared filesystem assumed) while the node's other ranks
    wait, every rank's error reaches every rank, and every rank must hold the same rows
    (their fingerprints gathered: tokenization is deterministic, so the nodes agree)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return prepare_corpus(dataset, training, model_dir, where, log)
    preparer = int(os.environ.get("LOCAL_RANK", "0")) == 0
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=PREPARE_TIMEOUT_S))
    try:
        corpus, error = None, ""
        try:
            corpus = prepare_corpus(dataset, training, model_dir, where, log, prepare=preparer)
        except DataError as exc:
            error = str(exc)
        _raise_first([error], group)
        if corpus is None:  # this node's preparer has written it
            corpus = prepare_corpus(dataset, training, model_dir, where, log=False, prepare=False)
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, corpus.fingerprint if corpus is not None else "", group=group)
        differing = [rank for rank, other in enumerate(found) if other != found[0]]
        if differing:
            raise DataError(f"{where}: dataset.path: rank(s) {differing} hold other packed rows than rank 0 "
                            f"(fingerprints {[str(found[r])[:12] for r in differing]}, rank 0 {found[0][:12]}): the "
                            f"nodes' data files or tokenizers differ; give every node the same files")
        return corpus
    finally:
        dist.destroy_process_group(group)


def _raise_first(errors: list[str], group: Any) -> None:
    """Every rank's error gathered; the first one raised on every rank."""
    import torch.distributed as dist

    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, errors[0], group=group)
    first = next((error for error in found if error), "")
    if first:
        raise DataError(first)


def _shown(files: list[Path]) -> str:
    """The dataset's files as a message names them."""
    return str(files[0]) if len(files) == 1 else f"{files[0].parent} ({len(files)} files)"


def _unit(dataset: DatasetConfig) -> str:
    """What one document is, for the empty-dataset message."""
    if dataset.kind == "text":
        return {"line": "line", "paragraph": "paragraph", "document": "file"}[dataset.sample_by]
    return f"row's {dataset.text_column!r}"


def check_vocabulary(corpus: PackedCorpus, vocab_size: int, model_dir: Path, where: str) -> None:
    """Every token id fits the model's embedding: a tokenizer larger than the model's
    vocabulary would fail inside the embedding lookup, on every rank, as a traceback."""
    largest = corpus.max_token
    if largest >= vocab_size:
        raise DataError(f"{where}: model.pretrained_model_name_or_path: the tokenizer in {model_dir} gives token id "
                        f"{largest}, the model's vocab_size is {vocab_size}; use the model's own tokenizer")


def row_indices(first_row: int, count: int, num_rows: int, seed: int, shuffle: bool) -> torch.Tensor:
    """The corpus rows at data positions ``first_row .. first_row + count``: position ``p``
    is row ``p mod num_rows`` of epoch ``p // num_rows``, through that epoch's seeded
    permutation when ``shuffle``. A pure function of its arguments: every rank, and a
    resumed run, computes the same rows."""
    positions = torch.arange(first_row, first_row + count)
    if not shuffle:
        return positions % num_rows
    out = torch.empty(count, dtype=torch.long)
    epochs = positions // num_rows
    for epoch in epochs.unique().tolist():
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(num_rows, generator=generator)
        mask = epochs == epoch
        out[mask] = order[positions[mask] % num_rows]
    return out


def corpus_batch(corpus: PackedCorpus, first_row: int, training: TrainingConfig, shuffle: bool) -> torch.Tensor:
    """The step's ``[global_batch_size, seq_len]`` rows (int64 token ids) starting at data
    position ``first_row``."""
    index = row_indices(first_row, training.global_batch_size, corpus.num_rows, training.seed, shuffle)
    return corpus.take(index)
