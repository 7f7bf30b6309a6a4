"""From the dataset's files to token ids: the documents read with HF ``datasets`` (local
files, streamed), tokenized with the model folder's tokenizer by the preparing rank or by a
pool of worker processes, in order, with a progress bar (a terminal) or progress lines (a log).

Why worker processes as well as the fast tokenizer's own threads: a fast tokenizer's batch
call already spreads over the cores (Rust threads), but reading the files, the slow
(Python) tokenizers and the conversion of ids are one Python thread. Workers take whole
batches of documents, each worker tokenizing on one thread, while the preparing rank reads
the next batches; results come back in submission order, so the token stream is the same
whichever the number of workers. At most two batches per worker are in flight, so memory
stays flat in the corpus size.
"""

import itertools
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from hyper_parallel.config.schema import DatasetConfig
from hyper_parallel.trainer.data import DataError

_LOG = logging.getLogger(__name__)

BUILDERS = {"text": "text", "jsonl": "json", "parquet": "parquet"}  # datasets' packaged builder per kind
TOKENIZE_BATCH = 1000  # documents per tokenizer call (the fast tokenizer batches them in Rust)
BATCH_CHARS = 4 << 20  # ... or fewer, when they reach this many characters (long documents: memory stays flat)
PROGRESS_EVERY_S = 5.0
AUTO_WORKERS_FROM_BYTES = 64 << 20  # tokenize_workers 0: workers from this much data on (their start costs seconds)
AUTO_WORKERS_MAX = 16


def shown_files(files: list[Path]) -> str:
    """The dataset's files as a message names them."""
    return str(files[0]) if len(files) == 1 else f"{files[0].parent} ({len(files)} files)"


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
    # its own progress bars, notes and error lines would repeat on every rank (a reader's
    # error reaches the user as one named line, _file_documents)
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    return datasets


def iter_batches(dataset: DatasetConfig, files: list[Path], where: str,
                 progress: Callable[[int], None] | None = None) -> Iterator[list[str]]:
    """The documents' texts in batches of ``TOKENIZE_BATCH`` documents or ``BATCH_CHARS``
    characters, whichever comes first, in file order then row order (``datasets``
    streaming: rows are read as they are tokenized, no Arrow copy is made). Empty documents
    are skipped. ``progress`` is told each file's size once it is read."""
    batch: list[str] = []
    chars = 0
    for file in files:
        for text in _file_documents(dataset, file, where):
            batch.append(text)
            chars += len(text)
            if len(batch) == TOKENIZE_BATCH or chars >= BATCH_CHARS:
                yield batch
                batch, chars = [], 0
        if progress is not None:
            progress(file.stat().st_size)
    if batch:
        yield batch


def _file_documents(dataset: DatasetConfig, file: Path, where: str) -> Iterator[str]:
    """One file's non-empty documents; a reader's error as one named line."""
    datasets = _import_datasets(dataset.kind, where)
    options = {"sample_by": dataset.sample_by} if dataset.kind == "text" else {}
    column = "text" if dataset.kind == "text" else dataset.text_column
    try:
        stream = datasets.load_dataset(BUILDERS[dataset.kind], data_files=[str(file)], split="train",
                                       streaming=True, **options)
        index = 0
        for rows in stream.iter(batch_size=TOKENIZE_BATCH):  # a column's values at a time: cheaper than rows
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
        return
    except Exception as exc:  # noqa: BLE001 -- a reader's error is the user's file, named in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{where}: dataset.path: {file} cannot be read as {dataset.kind} ({first[:300]}); "
                        f"fix the file or dataset.kind") from None


def encode(tokenizer, texts: list[str]) -> np.ndarray:
    """The texts' token ids, each text followed by EOS, as one int32 array."""
    eos = tokenizer.eos_token_id
    ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return np.fromiter(itertools.chain.from_iterable(doc + [eos] for doc in ids), dtype=np.int32)


def worker_count(dataset: DatasetConfig, data_bytes: int) -> int:
    """``dataset.tokenize_workers``, 0 resolved: one per core (at most 16) from 64 MB of data
    on, else none (1: the preparing rank tokenizes)."""
    if dataset.tokenize_workers:
        return dataset.tokenize_workers
    if data_bytes < AUTO_WORKERS_FROM_BYTES:
        return 1
    return max(1, min(len(os.sched_getaffinity(0)), AUTO_WORKERS_MAX))


def tokenized(batches: Iterator[list[str]], tokenizer, model_dir: Path, workers: int,
              where: str) -> Iterator[tuple[int, int, np.ndarray]]:
    """(documents, characters, their tokens) per batch, in order: tokenized here, or by ``workers``
    processes (spawned: the rank's threads and process group are not forked) that each load
    the tokenizer from ``model_dir``."""
    if workers <= 1:
        for batch in batches:
            yield len(batch), sum(map(len, batch)), encode(tokenizer, batch)
        return
    expected = (tokenizer.eos_token_id, len(tokenizer))
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"),
                               initializer=_start_worker, initargs=(str(model_dir), expected))
    try:
        pending: deque = deque()
        for batch in batches:
            pending.append((len(batch), sum(map(len, batch)), pool.submit(_encode_in_worker, batch)))
            if len(pending) >= 2 * workers:  # bounded: the reader runs at most this far ahead
                count, chars, future = pending.popleft()
                yield count, chars, _result(future, workers, model_dir, where)
        while pending:
            count, chars, future = pending.popleft()
            yield count, chars, _result(future, workers, model_dir, where)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _result(future, workers: int, model_dir: Path, where: str) -> np.ndarray:
    """A worker's tokens; a worker that died, or loaded another tokenizer, is one named
    error, not a pool's traceback."""
    try:
        return future.result()
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None
    except BrokenProcessPool:
        raise DataError(f"{where}: dataset.tokenize_workers: a tokenizer process ended abruptly (killed: out of "
                        f"memory?) while tokenizing with {model_dir}; fix: fewer tokenize_workers, or 1 to tokenize in the "
                        f"preparing rank ({workers} were running)") from None


_WORKER_TOKENIZER = None


_WORKER_PROBLEM = ""


def _start_worker(model_dir: str, expected: tuple[int, int]) -> None:
    """A worker's tokenizer, loaded once; one thread each (the workers are the parallelism).
    It must be the preparing rank's (EOS id and vocabulary size; a folder changed since
    would give rows stored under the other tokenizer's key); the worker dies with its rank."""
    global _WORKER_TOKENIZER, _WORKER_PROBLEM
    from hyper_parallel.launch.guard import die_with_parent

    die_with_parent()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from transformers import AutoTokenizer

    try:
        _WORKER_TOKENIZER = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        found = (_WORKER_TOKENIZER.eos_token_id, len(_WORKER_TOKENIZER))
    except Exception as exc:  # noqa: BLE001 -- said by the first batch, as one named line
        found = (None, f"{type(exc).__name__}: {exc}")
    if found != expected:
        _WORKER_PROBLEM = (f"model.pretrained_model_name_or_path: a tokenizer process loaded another tokenizer from "
                           f"{model_dir} than the preparing rank (EOS id and vocabulary size {found}, expected "
                           f"{expected}): the folder changed during preparation; fix: leave it unchanged and prepare "
                           f"again")


def _encode_in_worker(texts: list[str]) -> np.ndarray:
    """``encode`` with the worker's tokenizer."""
    if _WORKER_PROBLEM:
        raise DataError(_WORKER_PROBLEM)
    return encode(_WORKER_TOKENIZER, texts)


class Progress:
    """How far the preparation is, by the data files' bytes: a tqdm bar on a terminal,
    else a log line every few seconds (a torchrun log is not a terminal). Within a file the
    bytes are estimated from the texts' lengths; each finished file sets the exact figure."""

    def __init__(self, total_bytes: int, show: bool):
        self.total, self.show, self.done_files, self.in_file = total_bytes, show, 0, 0
        self.documents = self.tokens = 0
        self.started = self.last = time.monotonic()
        self.bar = None
        if show and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", leave=False)

    def file_done(self, size: int) -> None:
        """A file is read: its size replaces the estimate."""
        self.done_files += size
        self.in_file = 0
        self._show()

    def batch_done(self, documents: int, tokens: int, chars: int) -> None:
        self.documents += documents
        self.tokens += tokens
        self.in_file += chars
        self._show()

    def _show(self) -> None:
        done = min(self.done_files + self.in_file, self.total)
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix_str(f"{self.tokens:,} tokens", refresh=False)
        elif self.show and time.monotonic() - self.last > PROGRESS_EVERY_S:
            self.last = time.monotonic()
            seconds = self.last - self.started
            _LOG.info(f"dataset: {100 * done / max(self.total, 1):.0f}% of {self.total / 1e6:,.1f} MB, "
                      f"{self.documents:,} documents, {self.tokens:,} tokens ({self.tokens / seconds / 1e6:.2f} M "
                      f"tokens/s, {seconds:.0f}s)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
