"""Training batches: synthetic tokens or a local file's bytes (``dataset.kind: bytes``),
identical on every rank for the same step, sliced by data-parallel rank. Tokenized text,
JSON lines and parquet datasets are trainer/corpus.py's."""

from collections.abc import Iterator
from pathlib import Path

import torch

from hyper_parallel.config.schema import DatasetConfig, TrainingConfig
from hyper_parallel.errors import HyperParallelError


class DataError(ValueError, HyperParallelError):
    """A dataset the trainer cannot read; names the recipe key."""


def global_batch(step: int, training: TrainingConfig, dataset: DatasetConfig, vocab_size: int,
                 text_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """The whole step's tokens, ``[global_batch_size, seq_len]``; the same on every rank
    (kinds synthetic and bytes: the batch is a function of the step)."""
    shape = (training.global_batch_size, training.seq_len)
    if dataset.kind == "synthetic":
        generator = torch.Generator().manual_seed(training.seed * 1_000_003 + step)
        return torch.randint(0, vocab_size, shape, generator=generator)
    count = shape[0] * shape[1]
    start = (step * count) % max(1, text_tokens.numel() - count)
    return text_tokens[start:start + count].view(shape)


def existing_dataset_path(dataset: DatasetConfig, where: str) -> Path:
    """``dataset.path`` resolved against the recipe's folder (``where``), refused in one line
    naming the key when it does not exist."""
    path = Path(dataset.path)
    if not path.is_absolute():
        path = Path(where).parent / path
    if not path.exists():
        raise DataError(f"{where}: dataset.path: {path} does not exist (relative paths start at the recipe's "
                        f"folder); fix dataset.path")
    return path


def bytes_dataset_file(dataset: DatasetConfig, needed: int, where: str) -> Path:
    """The bytes dataset's file, checked before any rank builds a model: it exists, is a
    file and holds at least one step's bytes. Relative paths start at the recipe's folder."""
    if not dataset.path:
        raise DataError(f"{where}: dataset.path: required when dataset.kind is 'bytes'")
    path = existing_dataset_path(dataset, where)
    if not path.is_file():
        raise DataError(f"{where}: dataset.path: {path} is not a file; expected a local file")
    size = path.stat().st_size
    if size < needed:
        raise DataError(f"{where}: dataset.path: {path} has {size} bytes, one step needs {needed} "
                        f"(global_batch_size * seq_len); use a larger file or smaller training sizes")
    return path


def read_byte_tokens(dataset: DatasetConfig, vocab_size: int, needed: int, where: str) -> torch.Tensor:
    """Bytes of a local file as token ids (``byte % vocab_size``): enough for a smoke test,
    no tokenizer needed."""
    data = bytes_dataset_file(dataset, needed, where).read_bytes()
    return torch.tensor(list(data), dtype=torch.long) % vocab_size


def micro_batches(batch: torch.Tensor, dp_rank: int, dp_size: int, micro_batch_size: int,
                  where: str) -> Iterator[torch.Tensor]:
    """This dp rank's rows, in micro-batches."""
    rows = batch.shape[0]
    if rows % (dp_size * micro_batch_size):
        raise DataError(f"{where}: training.global_batch_size {rows} must be a multiple of "
                        f"dp_size * micro_batch_size = {dp_size * micro_batch_size}")
    local = batch.chunk(dp_size, dim=0)[dp_rank]
    yield from local.split(micro_batch_size, dim=0)
