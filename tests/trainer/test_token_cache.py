"""Tokenize once (trainer/token_cache.py): the packed rows are written to the token cache
and memory-mapped; a second preparation reads no text and gives the same rows and
fingerprint; a changed data file, tokenizer or seq_len is another entry; ``prepare-data``
fills the cache from the command line; a training.eval hold-out keeps the rows mapped; an
unchanged data file is not hashed again; tokenizer processes give the same rows as one
process; the entry is written as the tokens come, whole rows only, nothing on failure."""

import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from hyper_parallel.config import load_training_config
from hyper_parallel.config.loading import RecipeError
from hyper_parallel.trainer import corpus as corpus_module
from hyper_parallel.trainer import token_cache
from hyper_parallel.trainer import tokenize as tokenize_module
from hyper_parallel.trainer.corpus import prepare_corpus
from hyper_parallel.trainer.data import DataError
from hyper_parallel.trainer.evaluation import hold_out
from hyper_parallel.trainer.stream import StreamedCorpus
from hyper_parallel.trainer.token_cache import HASHES_FILE, INDEX_FILE, ROWS_FILE, EntryWriter, load_entry
from tests.project_fixtures import REPO
from tests.trainer.corpus_fixtures import DOCUMENTS, corpus_recipe, model_with_tokenizer, write_jsonl


@pytest.fixture
def recipe(tmp_path):
    model_with_tokenizer(tmp_path / "model")
    write_jsonl(tmp_path / "data.jsonl")
    return corpus_recipe(tmp_path, {"kind": "jsonl", "path": "data.jsonl", "cache_dir": "tokens"})


def _prepare(recipe_path, **options):
    config = load_training_config(recipe_path)
    return prepare_corpus(config.dataset, config.training, recipe_path.parent / "model", config.where, log=False,
                          **options)


def _mapped_from(tensor: torch.Tensor, path) -> bool:
    """The tensor's memory lies in a mapping of ``path`` (this process's /proc/self/maps)."""
    address = tensor.data_ptr()
    for line in open("/proc/self/maps"):
        span, *_, name = line.split(maxsplit=5) if len(line.split()) >= 6 else (line.split()[0], "")
        start, end = (int(part, 16) for part in span.split("-"))
        if name.strip() == str(path) and start <= address < end:
            return True
    return False


def test_a_second_preparation_reads_the_cache_not_the_text(recipe, monkeypatch):
    first = _prepare(recipe)
    assert first.cache.parent == recipe.parent / "tokens"
    assert sorted(p.name for p in first.cache.iterdir()) == [INDEX_FILE, ROWS_FILE]
    assert _mapped_from(first.rows, first.cache / ROWS_FILE)  # the file's pages, not a copy in memory

    def no_reading(*args, **kwargs):
        raise AssertionError("the text was read again")

    monkeypatch.setattr(corpus_module, "iter_batches", no_reading)
    second = _prepare(recipe)
    assert second.cache == first.cache and second.fingerprint == first.fingerprint
    assert torch.equal(second.rows, first.rows) and second.documents == len(DOCUMENTS)
    assert second.max_token == int(first.rows.max())


def test_a_changed_data_file_tokenizer_or_seq_len_is_a_new_entry(recipe):
    first = _prepare(recipe)
    (recipe.parent / "data.jsonl").write_text((recipe.parent / "data.jsonl").read_text().replace("w1 ", "w2 ", 1))
    changed = _prepare(recipe)
    assert changed.cache != first.cache and changed.fingerprint != first.fingerprint
    recipe.write_text(recipe.read_text().replace("seq_len: 12", "seq_len: 10"))
    shorter = _prepare(recipe)
    assert shorter.cache not in (first.cache, changed.cache) and shorter.rows.shape[1] == 10


def test_without_permission_to_prepare_a_missing_entry_is_none(recipe):
    assert _prepare(recipe, prepare=False) is None  # a rank whose node's local rank 0 prepares it
    _prepare(recipe)
    assert _prepare(recipe, prepare=False) is not None


def test_a_hold_out_keeps_the_rows_mapped_and_numbers_the_training_rows(recipe):
    corpus = _prepare(recipe)
    config = load_training_config(recipe)
    config.training.eval = type("Eval", (), {"batches": 1})()
    train, held = hold_out(corpus, config)
    assert train.rows is corpus.rows and train.num_rows == corpus.num_rows - config.training.global_batch_size
    every = torch.cat([train.take(torch.arange(train.num_rows)), held])
    assert sorted(map(tuple, every.tolist())) == sorted(map(tuple, corpus.rows.long().tolist()))


def test_prepare_data_command_fills_the_cache(recipe):
    proc = subprocess.run([sys.executable, "-m", "hyper_parallel.trainer", "prepare-data", "--config", str(recipe)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sequences of 12 tokens from 30 documents" in proc.stdout, proc.stdout
    assert _prepare(recipe, prepare=False) is not None
    bad = subprocess.run([sys.executable, "-m", "hyper_parallel.trainer", "prepare-data", "--config",
                          str(REPO / "recipes/tiny_cpu/qwen3_moe_tiny.yaml")], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "dataset.kind: 'synthetic' is not tokenized" in bad.stderr, bad.stderr


def test_an_unchanged_data_file_is_not_read_to_key_the_cache(recipe, monkeypatch):
    monkeypatch.setattr(token_cache, "RACY_NS", 0)  # the file was written just now; remember it anyway
    data = recipe.parent / "data.jsonl"
    first = _prepare(recipe)
    assert str(data.resolve()) in json.loads((first.cache.parent / HASHES_FILE).read_text())
    real = token_cache.file_sha256

    def only_the_tokenizer(path):
        assert path.name != "data.jsonl", "the unchanged data file was hashed again"
        return real(path)

    monkeypatch.setattr(token_cache, "file_sha256", only_the_tokenizer)
    assert _prepare(recipe).cache == first.cache
    monkeypatch.setattr(token_cache, "file_sha256", real)
    data.write_text(data.read_text())  # the same bytes, a new time: hashed again, the same entry
    assert _prepare(recipe).cache == first.cache
    stat = data.stat()
    data.write_text(data.read_text().replace("w1 ", "w2 ", 1))  # the same size, other bytes...
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ... and the old mtime (cp -p, rsync -t)
    assert data.stat().st_size == stat.st_size and data.stat().st_mtime_ns == stat.st_mtime_ns
    assert _prepare(recipe).cache != first.cache  # the status-change time moved


def test_a_damaged_or_abandoned_entry_is_replaced(recipe, monkeypatch):
    first = _prepare(recipe)
    (first.cache / INDEX_FILE).unlink()  # a damaged entry: rewritten, not a crash
    again = _prepare(recipe)
    assert again.cache == first.cache and torch.equal(again.rows, first.rows)
    abandoned = first.cache.parent / f".{'0' * 64}-12345-deadbeef"  # a writer killed midway, long ago
    abandoned.mkdir()
    (abandoned / ROWS_FILE).write_bytes(b"\0" * 64)
    old = time.time() - token_cache.ABANDONED_S - 60
    os.utime(abandoned / ROWS_FILE, (old, old))
    os.utime(abandoned, (old, old))
    fresh = first.cache.parent / f".{'1' * 64}-12346-cafecafe"  # a writer at work: kept
    fresh.mkdir()
    recipe.write_text(recipe.read_text().replace("seq_len: 12", "seq_len: 10"))  # a missing entry: prepared
    _prepare(recipe)
    assert not abandoned.exists() and fresh.exists()


def test_a_cache_dir_that_is_a_file_is_named(recipe):
    (recipe.parent / "tokens").write_text("not a folder")
    with pytest.raises(DataError, match=r"dataset.cache_dir: .*tokens is a file; expected a folder"):
        _prepare(recipe)


def test_long_documents_make_smaller_batches(recipe, monkeypatch):
    monkeypatch.setattr(tokenize_module, "BATCH_CHARS", 50)
    config = load_training_config(recipe)
    batches = list(tokenize_module.iter_batches(config.dataset, [recipe.parent / "data.jsonl"], config.where))
    assert [text for batch in batches for text in batch] == DOCUMENTS
    assert all(sum(map(len, batch[:-1])) < 50 for batch in batches) and len(batches) > 5


def test_a_tokenizer_process_with_another_tokenizer_is_refused(recipe):
    config = load_training_config(recipe)

    class Other:  # the preparing rank's tokenizer, as if the folder changed after it loaded it
        eos_token_id = 12345

        def __len__(self):
            return 7

    batches = tokenize_module.iter_batches(config.dataset, [recipe.parent / "data.jsonl"], config.where)
    with pytest.raises(DataError, match="a tokenizer process loaded another tokenizer from"):
        list(tokenize_module.tokenized(batches, Other(), recipe.parent / "model", 2, config.where))


def test_tokenizer_processes_give_the_rows_of_one_process(recipe, monkeypatch):
    monkeypatch.setattr(tokenize_module, "TOKENIZE_BATCH", 4)  # several batches in flight
    alone = _prepare(recipe)
    recipe.write_text(recipe.read_text().replace("cache_dir: tokens", "cache_dir: tokens2\n  tokenize_workers: 2"))

    def not_here(*args):
        raise AssertionError("the preparing process tokenized: no workers ran")

    monkeypatch.setattr(tokenize_module, "encode", not_here)  # the spawned workers import their own
    pooled = _prepare(recipe)
    assert pooled.cache.parent.name == "tokens2" and pooled.cache.name == alone.cache.name
    assert pooled.fingerprint == alone.fingerprint and torch.equal(pooled.rows, alone.rows)
    assert (pooled.documents, pooled.max_token) == (alone.documents, alone.max_token)


def test_the_entry_writer_keeps_whole_rows_of_the_stream(tmp_path):
    stream = np.random.default_rng(0).integers(0, 1000, 1003, dtype=np.int32)
    with EntryWriter(tmp_path / "entry", 10) as writer:
        for start, stop in ((0, 3), (3, 3), (3, 250), (250, 1003)):  # chunks that cut rows anywhere
            writer.append(stream[start:stop])
        writer.commit(documents=7)
    rows, index = load_entry(tmp_path / "entry")
    want = stream[:1000].reshape(100, 10)
    assert np.array_equal(rows.numpy(), want) and index["tokens"] == 1003 and index["documents"] == 7
    assert index["fingerprint"] == hashlib.sha256(want.tobytes()).hexdigest()
    assert index["max_token"] == int(want.max()) and sorted(p.name for p in tmp_path.iterdir()) == ["entry"]
    with pytest.raises(RuntimeError), EntryWriter(tmp_path / "failed", 10) as writer:
        writer.append(stream)
        raise RuntimeError("tokenizing failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]  # nothing half written


def test_a_streamed_dataset_gives_the_cached_rows_in_order_and_writes_no_cache(recipe):
    cached = _prepare(recipe)
    recipe.write_text(recipe.read_text().replace("cache_dir: tokens", "cache_dir: tokens\n  streaming: true"))
    config = load_training_config(recipe)
    assert config.dataset.shuffle is False  # the default under streaming
    streamed = _prepare(recipe)
    assert isinstance(streamed, StreamedCorpus) and streamed.fingerprint == f"stream:{cached.cache.name}"
    entries = [p.name for p in cached.cache.parent.iterdir() if p.is_dir()]
    assert entries == [cached.cache.name]  # none written for the stream
    rows, step = cached.rows.long(), config.training.global_batch_size
    wrapped = torch.cat([rows, rows, rows])  # past the end of a pass the rows start again
    for first in (0, step, 3, rows.shape[0] - 1, 2 * rows.shape[0] + 1, 1):  # on, ahead, into epochs, back
        got = corpus_module.corpus_batch(streamed, first, config.training, shuffle=False)
        assert torch.equal(got, wrapped[first:first + step]), first
    assert streamed.num_rows == rows.shape[0]  # known once a pass was read
    passes = []
    real_pass = streamed._pass
    streamed._pass = lambda: passes.append(1) or real_pass()
    far = 1000 * rows.shape[0] + 5  # a resumed run many epochs in: whole passes are stepped over, not read
    got = corpus_module.corpus_batch(streamed, far, config.training, shuffle=False)
    assert torch.equal(got, wrapped[5:5 + step]) and len(passes) <= 2
    corpus_module.check_vocabulary(streamed, int(rows.max()), recipe.parent / "model", config.where)
    with pytest.raises(DataError, match=r"token id \d+, the model's vocab_size is"):
        for first in range(0, 3 * rows.shape[0], step):
            corpus_module.corpus_batch(streamed, first, config.training, shuffle=False)


def test_a_streamed_dataset_refuses_what_it_cannot_apply(recipe):
    text = recipe.read_text().replace("cache_dir: tokens", "cache_dir: tokens\n  streaming: true")
    for extra, key in (("\n  shuffle: true", "dataset.shuffle: true cannot apply"),
                       ("\n  tokenize_workers: 2", "dataset.tokenize_workers: has no effect")):
        recipe.write_text(text.replace("streaming: true", "streaming: true" + extra))
        with pytest.raises(RecipeError, match=key):
            load_training_config(recipe)
    recipe.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "hyper_parallel.trainer", "prepare-data", "--config", str(recipe)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "dataset.streaming: true reads and tokenizes the files during training" \
        in proc.stderr, proc.stderr
