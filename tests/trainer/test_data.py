"""Training batches: the same on every rank for a step, sliced by dp rank; a file's bytes too."""

import pytest
import torch

from hyper_parallel.config.schema import DatasetConfig, TrainingConfig
from hyper_parallel.trainer.data import DataError, global_batch, micro_batches, read_byte_tokens


def test_synthetic_batches_are_reproducible_and_differ_by_step():
    training = TrainingConfig(global_batch_size=4, seq_len=8, seed=3)
    first = global_batch(0, training, DatasetConfig(), vocab_size=50)
    assert torch.equal(first, global_batch(0, training, DatasetConfig(), vocab_size=50))
    assert not torch.equal(first, global_batch(1, training, DatasetConfig(), vocab_size=50))
    assert first.shape == (4, 8) and int(first.max()) < 50


def test_text_file_tokens_feed_the_batches(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    (tmp_path / "corpus.txt").write_text("hello world, " * 20)
    dataset = DatasetConfig(kind="bytes", path="corpus.txt")
    training = TrainingConfig(global_batch_size=2, seq_len=8)
    tokens = read_byte_tokens(dataset, vocab_size=256, needed=16, where=str(recipe))
    batch = global_batch(0, training, dataset, 256, tokens)
    assert bytes(batch.flatten().tolist()) == b"hello world, hel"


def test_too_short_text_file_names_the_key(tmp_path):
    (tmp_path / "tiny.txt").write_text("abc")
    with pytest.raises(DataError, match=r"dataset\.path: .*tiny\.txt has 3 bytes, one step needs 16"):
        read_byte_tokens(DatasetConfig(kind="bytes", path="tiny.txt"), 256, 16, str(tmp_path / "r.yaml"))


def test_micro_batches_split_the_dp_ranks_rows():
    batch = torch.arange(24).view(4, 6)
    parts = list(micro_batches(batch, dp_rank=1, dp_size=2, micro_batch_size=1, where="r.yaml"))
    assert [p.tolist() for p in parts] == [[list(range(12, 18))], [list(range(18, 24))]]
    with pytest.raises(DataError, match="global_batch_size 4 must be a multiple of dp_size \\* micro_batch_size = 6"):
        list(micro_batches(batch, 0, 2, 3, "r.yaml"))
