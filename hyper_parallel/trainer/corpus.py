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

import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from hyper_parallel.config.schema import DatasetConfig, TrainingConfig
from hyper_parallel.distributed.ranks import group_of_several_ranks, node_of_this_rank
from hyper_parallel.trainer.data import DataError, existing_dataset_path
from hyper_parallel.trainer.stream import StreamedCorpus, open_stream
from hyper_parallel.trainer.token_cache import EntryWriter, cache_key, cache_root, load_entry, remove_abandoned
from hyper_parallel.trainer.tokenize import Progress, iter_batches, load_tokenizer, shown_files, tokenized, worker_count

_LOG = logging.getLogger(__name__)

# The files a folder path contributes, per kind (``datasets`` reads each file by its kind,
# whatever its name; these only choose which files of a folder are data).
SUFFIXES = {"text": (".txt", ".text"), "jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}
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


def prepare_corpus(dataset: DatasetConfig, training: TrainingConfig, model_dir: Path, where: str,
                   log: bool = True, prepare: bool = True) -> PackedCorpus | StreamedCorpus | None:
    """The recipe's dataset as packed rows (``dataset.streaming``: read as training asks
    for them, trainer/stream.py), memory-mapped from the token cache
    (trainer/token_cache.py): read from there when an entry for these files, tokenizer and
    settings exists, else (``prepare``) read, tokenized, packed and written there first;
    None where it must be prepared and ``prepare`` is off (another rank prepares it).
    Enough rows for one step, else a named error."""
    files = dataset_files(dataset, where)
    root = cache_root(dataset, where)
    key = cache_key(dataset, training.seq_len, files, model_dir, root)
    if dataset.streaming:
        return open_stream(dataset, training, model_dir, where, files, key, log)
    folder = root / key
    shown = shown_files(files)
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
    """Read, tokenize and pack the dataset straight into the cache entry ``folder`` (memory
    flat in the corpus size); the seconds it took."""
    tokenizer = load_tokenizer(model_dir, where, dataset.kind)
    started = time.monotonic()
    for abandoned in remove_abandoned(folder.parent):
        _LOG.warning(f"dataset: removed {abandoned}, a preparation that stopped without finishing")
    data_bytes = sum(file.stat().st_size for file in files)
    workers = worker_count(dataset, data_bytes)
    if log:
        how = f"{workers} tokenizer processes" if workers > 1 else "this process"
        _LOG.info(f"dataset: reading {len(files)} {dataset.kind} file(s) ({data_bytes / 1e6:,.1f} MB) from "
                  f"{dataset.path}, tokenizing with {model_dir} in {how}")
    progress = Progress(data_bytes, show=log)
    documents = 0
    try:
        with EntryWriter(folder, training.seq_len) as entry:
            batches = iter_batches(dataset, files, where, progress=progress.file_done)
            for count, chars, tokens in tokenized(batches, tokenizer, model_dir, workers, where):
                entry.append(tokens)
                documents += count
                progress.batch_done(count, tokens.size, chars)
            if documents == 0:
                raise DataError(f"{where}: dataset.path: {shown_files(files)} holds no documents (every "
                                f"{_unit(dataset)} is empty); fix dataset.path")
            entry.commit(documents)
    finally:
        progress.close()
    return time.monotonic() - started


def prepare_corpus_on_every_node(dataset: DatasetConfig, training: TrainingConfig, model_dir: Path, where: str,
                                 log: bool = True) -> PackedCorpus | StreamedCorpus:
    """``prepare_corpus`` under torchrun: on each node the local rank 0 prepares a missing
    cache entry (its own disk: no shared filesystem assumed) while the node's other ranks
    wait, every rank's error reaches every rank, and every rank must hold the same rows
    (their fingerprints gathered: tokenization is deterministic, so the nodes agree)."""
    import torch.distributed as dist

    if not group_of_several_ranks():
        return prepare_corpus(dataset, training, model_dir, where, log)
    preparer = int(os.environ.get("LOCAL_RANK", "0")) == 0
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=PREPARE_TIMEOUT_S))
    try:
        corpus, error = None, ""
        try:
            corpus = prepare_corpus(dataset, training, model_dir, where, log, prepare=preparer)
        except DataError as exc:
            error = str(exc)
        _raise_first([error], group, where)
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


def _raise_first(errors: list[str], group: Any, where: str) -> None:
    """Every rank's error gathered; the first one raised on every rank. The gather waits at
    most ``PREPARE_TIMEOUT_S`` for the ranks still preparing: past it, or when a rank left,
    a named error on this rank rather than the process group's."""
    import torch.distributed as dist

    found: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(found, errors[0], group=group)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{where}: dataset: rank {dist.get_rank()} ({node_of_this_rank()}) did not hear from every "
                        f"rank within {PREPARE_TIMEOUT_S:.0f}s while each node's local rank 0 tokenized the dataset "
                        f"(a preparation that takes longer, or a rank that stopped: {first}); fix: run python -m "
                        f"hyper_parallel.trainer prepare-data --config <recipe> on every node first") from None
    first = next((error for error in found if error), "")
    if first:
        raise DataError(first)


def _unit(dataset: DatasetConfig) -> str:
    """What one document is, for the empty-dataset message."""
    if dataset.kind == "text":
        return {"line": "line", "paragraph": "paragraph", "document": "file"}[dataset.sample_by]
    return f"row's {dataset.text_column!r}"


def check_vocabulary(corpus: PackedCorpus | StreamedCorpus, vocab_size: int, model_dir: Path, where: str) -> None:
    """Every token id fits the model's embedding: a tokenizer larger than the model's
    vocabulary would fail inside the embedding lookup, on every rank, as a traceback."""
    if isinstance(corpus, StreamedCorpus):  # its rows are checked as they are read
        corpus.vocab_size = vocab_size
        return
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


def corpus_batch(corpus: PackedCorpus | StreamedCorpus, first_row: int, training: TrainingConfig,
                 shuffle: bool) -> torch.Tensor:
    """The step's ``[global_batch_size, seq_len]`` rows (int64 token ids) starting at data
    position ``first_row``."""
    if isinstance(corpus, StreamedCorpus):
        return corpus.rows_at(first_row, training.global_batch_size)
    index = row_indices(first_row, training.global_batch_size, corpus.num_rows, training.seed, shuffle)
    return corpus.take(index)
