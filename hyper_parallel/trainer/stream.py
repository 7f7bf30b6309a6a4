"""``dataset.streaming: true``: the packed rows read, tokenized and cut as training consumes
them, for corpora that do not fit on disk a second time (no token cache is written).

The rows are those the cache would hold, in the same order: every document followed by EOS,
in file order, one token stream cut into rows of ``seq_len``, the tail of a pass dropped; a
pass that ends starts the files again (the next epoch). So data position ``p`` is row
``p mod rows`` as with the cache and ``shuffle: false`` (a shuffled order needs every row at
hand; the loader refuses it, and ``training.eval``, which holds rows out, with streaming).

Costs, stated: every rank reads and tokenizes the whole stream (a rank must know where rows
start), in this process; a resumed run reads the stream again up to its data position within
its epoch (logged; at most one pass, then the row count is known); the vocabulary is checked
as rows are read, so a token id beyond the model's vocabulary stops the run when its row
comes. The position saved in a checkpoint is the row count, as with the cache; the data are
identified by the cache key (the files' sha256, the tokenizer, the settings), since the
rows' own sha256 would need a whole pass.
"""

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from hyper_parallel.config.schema import DatasetConfig, TrainingConfig
from hyper_parallel.trainer.data import DataError
from hyper_parallel.trainer.tokenize import PROGRESS_EVERY_S, encode, iter_batches, load_tokenizer, shown_files

_LOG = logging.getLogger(__name__)


class StreamedCorpus:
    """The packed rows of a dataset, read in order as they are asked for."""

    def __init__(self, dataset: DatasetConfig, training: TrainingConfig, model_dir: Path, where: str,
                 files: list[Path], key: str, log: bool):
        self.dataset, self.seq_len, self.where, self.files, self.log = dataset, training.seq_len, where, files, log
        self.model_dir, self.step_rows = model_dir, training.global_batch_size
        self.tokenizer = load_tokenizer(model_dir, where, dataset.kind)
        self.fingerprint = f"stream:{key}"
        self.vocab_size: int | None = None  # set by check_vocabulary: every row read is checked against it
        self.num_rows: int | None = None  # unknown until a whole pass is read
        self._rows: Iterator[np.ndarray] = iter(())
        self._position = 0  # the data position of the next row self._rows gives
        self._in_pass = 0  # rows the current pass gave so far
        self._pass_documents = self._pass_tokens = 0  # what the current pass read so far
        self._restart()

    def _restart(self) -> None:
        self._rows, self._position, self._in_pass = self._pass(), 0, 0

    def _pass(self) -> Iterator[np.ndarray]:
        """One pass over the files: the rows, in order."""
        tail = np.empty(0, dtype=np.int32)
        self._pass_documents = self._pass_tokens = 0
        for batch in iter_batches(self.dataset, self.files, self.where):
            tokens = encode(self.tokenizer, batch)
            self._pass_documents += len(batch)
            self._pass_tokens += tokens.size
            stream = np.concatenate([tail, tokens])
            whole = stream.size // self.seq_len * self.seq_len
            yield from stream[:whole].reshape(-1, self.seq_len)
            tail = stream[whole:]

    def _next_row(self) -> np.ndarray:
        """The row at the current position; at the end of a pass, the first row of the next."""
        row = next(self._rows, None)
        if row is None:
            self.num_rows = self._in_pass
            if self.num_rows < self.step_rows:
                raise DataError(f"{self.where}: dataset.path: {shown_files(self.files)} packs into {self.num_rows} "
                                f"sequence(s) of seq_len {self.seq_len} ({self._pass_tokens:,} tokens from "
                                f"{self._pass_documents} documents), one step needs training.global_batch_size = "
                                f"{self.step_rows}; use more data or smaller training sizes")
            self._rows, self._in_pass = self._pass(), 0  # the next epoch: the same rows again
            row = next(self._rows)
        self._position += 1
        self._in_pass += 1
        return row

    def rows_at(self, first_row: int, count: int) -> torch.Tensor:
        """Rows ``first_row .. first_row + count`` of the stream as int64 token ids. Read on
        from where the last call stopped; a position behind it starts the files again, one
        ahead of it reads the rows between (a resumed run: logged)."""
        if first_row < self._position:
            self._restart()
        if first_row > self._position:
            self._skip(first_row - self._position)
        rows = torch.from_numpy(np.stack([self._next_row() for _ in range(count)])).long()
        if self.vocab_size is not None and int(rows.max()) >= self.vocab_size:
            raise DataError(f"{self.where}: model.pretrained_model_name_or_path: the tokenizer in {self.model_dir} "
                            f"gives token id {int(rows.max())}, the model's vocab_size is {self.vocab_size}; use the "
                            f"model's own tokenizer")
        return rows

    def _skip(self, count: int) -> None:
        """Read ``count`` rows without using them, logging the progress; once a whole pass
        was read (the row count is known), whole passes are stepped over, not read."""
        started = last = time.monotonic()
        target = self._position + count
        if self.log:
            _LOG.info(f"dataset: streamed: reading up to {count:,} rows to reach data position {target:,}")
        while self._position < target:
            if self.num_rows and target - self._position >= self.num_rows:
                self._position += (target - self._position) // self.num_rows * self.num_rows  # the same rows again
                continue
            self._next_row()
            if self.log and time.monotonic() - last > PROGRESS_EVERY_S:
                last = time.monotonic()
                _LOG.info(f"dataset: streamed: at row {self._position:,} of {target:,} ({last - started:.0f}s)")


def open_stream(dataset: DatasetConfig, training: TrainingConfig, model_dir: Path, where: str, files: list[Path],
                key: str, log: bool) -> StreamedCorpus:
    """The streamed corpus, its first step's rows read once: a file that does not parse, a
    missing column or too little text is found before the model is built, as with the cache."""
    corpus = StreamedCorpus(dataset, training, model_dir, where, files, key, log)
    corpus.rows_at(0, training.global_batch_size)
    if log:
        _LOG.info(f"dataset: streamed from {len(files)} {dataset.kind} file(s) (dataset.streaming: no token cache; "
                  f"read in order)")
    return corpus
