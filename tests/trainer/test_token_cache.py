"""Tokenize once (trainer/token_cache.py): the packed rows are written to the token cache
and memory-mapped; a second preparation reads no text and gives the same rows and
fingerprint; a changed data file, tokenizer or seq_len is another entry; ``prepare-data``
fills the cache from the command line; a training.eval hold-out keeps the rows mapped."""

import subprocess
import sys

import pytest
import torch

from hyper_parallel.config import load_training_config
from hyper_parallel.trainer import corpus as corpus_module
from hyper_parallel.trainer.corpus import prepare_corpus
from hyper_parallel.trainer.evaluation import hold_out
from hyper_parallel.trainer.token_cache import INDEX_FILE, ROWS_FILE
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

    monkeypatch.setattr(corpus_module, "iter_documents", no_reading)
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
