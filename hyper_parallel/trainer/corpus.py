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

Every rank prepares the stream itself, before the model is built: it is a pure function
of the files and the tokenizer, so the ranks agree without talking, and an error (missing
file, no tokenizer, empty dataset, missing column) is found by every rank alike, said once
by rank 0 (``hyper_parallel.trainer.__main__``), and every rank exits with 2.
"""

import hashlib
import itertools
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hyper_parallel.config.schema import DatasetConfig, TrainingConfig
from hyper_parallel.trainer.data import DataError, existing_dataset_path

_LOG = logging.getLogger(__name__)

# The files a folder path contributes, per kind (``datasets`` reads each file by its kind,
# whatever its name; these only choose which files of a folder are data).
SUFFIXES = {"text": (".txt", ".text"), "jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}
BUILDERS = {"text": "text", "jsonl": "json", "parquet": "parquet"}  # datasets' packaged builder per kind
_TOKENIZE_BATCH = 1000  # documents per tokenizer call (the fast tokenizer batches them in Rust)
_PROGRESS_EVERY_S = 5.0


@dataclass
class PackedCorpus:
    """The packed token rows of a dataset and what identifies them in a checkpoint."""

    rows: torch.Tensor  # [num_rows, seq_len], int32 (half of int64's memory; batches are int64)
    documents: int
    fingerprint: str  # sha256 of the rows' bytes: a resumed run checks it trains on the same data

    @property
    def num_rows(self) -> int:
        """Packed sequences: the length of one epoch, in rows."""
        return self.rows.shape[0]


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
                   log: bool = True) -> PackedCorpus:
    """Read, tokenize and pack the recipe's dataset (every rank alike; see the module
    docstring). Enough rows for one step, else a named error."""
    files = dataset_files(dataset, where)
    tokenizer = load_tokenizer(model_dir, where, dataset.kind)
    started = time.monotonic()
    if log:
        _LOG.info(f"dataset: reading {len(files)} {dataset.kind} file(s) from {dataset.path}, tokenizing with "
                  f"{model_dir}")
    stream, documents = token_stream(iter_documents(dataset, files, where), tokenizer, log)
    shown = str(files[0]) if len(files) == 1 else f"{files[0].parent} ({len(files)} files)"
    if documents == 0:
        raise DataError(f"{where}: dataset.path: {shown} holds no documents (every {_unit(dataset)} is empty); "
                        f"fix dataset.path")
    rows = pack(stream, training.seq_len)
    if rows.shape[0] < training.global_batch_size:
        raise DataError(f"{where}: dataset.path: {shown} packs into {rows.shape[0]} sequence(s) of seq_len "
                        f"{training.seq_len} ({stream.numel():,} tokens from {documents} documents), one step needs "
                        f"training.global_batch_size = {training.global_batch_size}; use more data or smaller "
                        f"training sizes")
    fingerprint = hashlib.sha256(rows.numpy().tobytes()).hexdigest()
    if log:
        _LOG.info(f"dataset: {documents:,} documents, {stream.numel():,} tokens, {rows.shape[0]:,} sequences of "
                  f"{training.seq_len} ({time.monotonic() - started:.1f}s)")
    return PackedCorpus(rows, documents, fingerprint)


def _unit(dataset: DatasetConfig) -> str:
    """What one document is, for the empty-dataset message."""
    if dataset.kind == "text":
        return {"line": "line", "paragraph": "paragraph", "document": "file"}[dataset.sample_by]
    return f"row's {dataset.text_column!r}"


def check_vocabulary(corpus: PackedCorpus, vocab_size: int, model_dir: Path, where: str) -> None:
    """Every token id fits the model's embedding: a tokenizer larger than the model's
    vocabulary would fail inside the embedding lookup, on every rank, as a traceback."""
    largest = int(corpus.rows.max())
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
    return corpus.rows[index].long()
