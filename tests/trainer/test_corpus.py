"""Tokenized datasets (trainer/corpus.py) in one process: the packed rows equal a direct
tokenization of the documents with EOS after each; plain text, JSON lines and parquet
give the same rows; each step's rows split into disjoint dp shards that cover the batch,
and an epoch visits every row once; bad inputs are one line naming the recipe key, and the
trainer's ``main`` (on a one-rank process group) prints just that line and returns 2."""

import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.config.schema import DatasetConfig, TrainingConfig
from hyper_parallel.trainer.__main__ import main as trainer_main
from hyper_parallel.trainer.base import BaseTrainer
from hyper_parallel.trainer.checkpoint import CheckpointError, Resumed
from hyper_parallel.trainer.corpus import check_vocabulary, corpus_batch, prepare_corpus, row_indices
from hyper_parallel.trainer.data import DataError, micro_batches
from tests.trainer.corpus_fixtures import (
    BAD_DATASETS,
    DOCUMENTS,
    EOS,
    bad_dataset_folder,
    corpus_recipe,
    model_with_tokenizer,
    write_jsonl,
)

TRAINING = TrainingConfig(global_batch_size=4, micro_batch_size=1, seq_len=12, seed=5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return model_with_tokenizer(tmp_path_factory.mktemp("corpus") / "model")


def _direct_stream(model_dir, documents=DOCUMENTS) -> list[int]:
    """What packing must give, tokenized here one document at a time."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    stream = []
    for text in documents:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
    return stream


def _prepare(tmp_path, model_dir, **dataset):
    return prepare_corpus(DatasetConfig(**dataset), TRAINING, model_dir, str(tmp_path / "recipe.yaml"), log=False)


def test_jsonl_packs_the_direct_tokenization_with_eos_between_documents(tmp_path, model_dir):
    write_jsonl(tmp_path / "corpus.jsonl")
    corpus = _prepare(tmp_path, model_dir, kind="jsonl", path="corpus.jsonl")
    stream = _direct_stream(model_dir)
    rows = len(stream) // 12
    assert corpus.documents == len(DOCUMENTS) and corpus.rows.shape == (rows, 12)
    assert corpus.rows.flatten().tolist() == stream[:rows * 12]
    eos = stream[-1]
    assert corpus.rows.flatten().tolist().count(eos) == stream[:rows * 12].count(eos) >= len(DOCUMENTS) - 2
    assert 0 not in stream  # every word is in the vocabulary: no <unk>


def test_text_and_parquet_give_the_same_rows(tmp_path, model_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "corpus.jsonl")
    (tmp_path / "lines.txt").write_text("\n".join(DOCUMENTS) + "\n\n")  # an empty line is no document
    (tmp_path / "paragraphs.txt").write_text("\n\n".join(DOCUMENTS))
    (tmp_path / "shards").mkdir()
    for part, start in enumerate(range(0, len(DOCUMENTS), 12)):  # a folder of parquet shards, in name order
        pq.write_table(pa.table({"body": DOCUMENTS[start:start + 12]}), tmp_path / "shards" / f"part-{part}.parquet")
    want = _prepare(tmp_path, model_dir, kind="jsonl", path="corpus.jsonl")
    for dataset in ({"kind": "text", "path": "lines.txt"},
                    {"kind": "text", "path": "paragraphs.txt", "sample_by": "paragraph"},
                    {"kind": "parquet", "path": "shards", "text_column": "body"}):
        got = _prepare(tmp_path, model_dir, **dataset)
        assert torch.equal(got.rows, want.rows) and got.fingerprint == want.fingerprint, dataset


@pytest.mark.parametrize("shuffle", [False, True])
def test_dp_shards_are_disjoint_and_cover_each_step_and_each_epoch(tmp_path, model_dir, shuffle):
    write_jsonl(tmp_path / "corpus.jsonl")
    corpus = _prepare(tmp_path, model_dir, kind="jsonl", path="corpus.jsonl", shuffle=shuffle)
    rows = {tuple(r) for r in corpus.rows.tolist()}
    assert len(rows) == corpus.num_rows  # distinct rows, so rows can be told apart by content
    steps = corpus.num_rows // TRAINING.global_batch_size
    seen = []
    for step in range(steps):
        batch = corpus_batch(corpus, step * 4, TRAINING, shuffle)
        shards = [torch.cat(list(micro_batches(batch, rank, 2, 1, "r.yaml"))) for rank in (0, 1)]
        assert torch.equal(torch.cat(shards), batch)  # the dp shards together are the batch, in order
        assert not {tuple(r) for r in shards[0].tolist()} & {tuple(r) for r in shards[1].tolist()}
        seen += [tuple(r) for r in batch.tolist()]
    assert len(seen) == len(set(seen)) == steps * 4  # no row twice within an epoch
    order = row_indices(0, corpus.num_rows, corpus.num_rows, TRAINING.seed, shuffle)
    assert sorted(order.tolist()) == list(range(corpus.num_rows))
    assert (order.tolist() != list(range(corpus.num_rows))) == shuffle
    # the next epoch visits every row again, in another order when shuffled
    again = row_indices(corpus.num_rows, corpus.num_rows, corpus.num_rows, TRAINING.seed, shuffle)
    assert sorted(again.tolist()) == list(range(corpus.num_rows)) and (again.tolist() != order.tolist()) == shuffle


def test_bad_inputs_name_the_recipe_key(tmp_path, model_dir):
    where = str(tmp_path / "recipe.yaml")
    write_jsonl(tmp_path / "corpus.jsonl")
    cases = [
        ({"kind": "jsonl", "path": "nope.jsonl"}, model_dir,
         f"{where}: dataset.path: {tmp_path / 'nope.jsonl'} does not exist"),
        ({"kind": "jsonl", "path": "corpus.jsonl"}, tmp_path,
         f"{where}: model.pretrained_model_name_or_path: {tmp_path} has no tokenizer"),
        ({"kind": "jsonl", "path": "corpus.jsonl", "text_column": "content"}, model_dir,
         f"{where}: dataset.text_column: {tmp_path / 'corpus.jsonl'} has no column 'content' (its columns: id, text)"),
    ]
    (tmp_path / "empty.jsonl").write_text("")
    cases.append(({"kind": "jsonl", "path": "empty.jsonl"}, model_dir,
                  f"{where}: dataset.path: {tmp_path / 'empty.jsonl'} holds no documents"))
    (tmp_path / "blank.txt").write_text("\n\n\n")
    cases.append(({"kind": "text", "path": "blank.txt"}, model_dir,
                  f"{where}: dataset.path: {tmp_path / 'blank.txt'} holds no documents (every line is empty)"))
    (tmp_path / "broken.jsonl").write_text('{"text": "w1"}\nnot json\n')
    cases.append(({"kind": "jsonl", "path": "broken.jsonl"}, model_dir,
                  f"{where}: dataset.path: {tmp_path / 'broken.jsonl'} cannot be read as jsonl"))
    (tmp_path / "numbers.jsonl").write_text('{"text": 5}\n')
    cases.append(({"kind": "jsonl", "path": "numbers.jsonl"}, model_dir,
                  f"{where}: dataset.text_column: {tmp_path / 'numbers.jsonl'} row 0: 'text' holds int, expected text"))
    (tmp_path / "short.jsonl").write_text('{"text": "w1 w2"}\n')
    cases.append(({"kind": "jsonl", "path": "short.jsonl"}, model_dir,
                  f"{where}: dataset.path: {tmp_path / 'short.jsonl'} packs into 0 sequence(s) of seq_len 12"))
    for dataset, folder, message in cases:
        with pytest.raises(DataError) as caught:
            prepare_corpus(DatasetConfig(**dataset), TRAINING, folder, where, log=False)
        assert str(caught.value).startswith(message), (dataset, str(caught.value))
        assert "\n" not in str(caught.value)
    corpus = _prepare(tmp_path, model_dir, kind="jsonl", path="corpus.jsonl")
    with pytest.raises(DataError, match=r"gives token id \d+, the model's vocab_size is 10"):
        check_vocabulary(corpus, 10, model_dir, where)


def test_a_resumed_run_starts_at_the_recorded_row_of_the_same_data_only(tmp_path, model_dir):
    write_jsonl(tmp_path / "corpus.jsonl")
    corpus = _prepare(tmp_path, model_dir, kind="jsonl", path="corpus.jsonl")
    trainer = SimpleNamespace(corpus=corpus, rank=0, config=SimpleNamespace(
        dataset=DatasetConfig(kind="jsonl", path="corpus.jsonl"), training=TRAINING, where="r.yaml"))
    saved = {"kind": "jsonl", "next_step": 2, "next_row": 8, "fingerprint": corpus.fingerprint}
    assert BaseTrainer._data_start(trainer, Resumed(Path("ck/step_2"), 2, saved), 2) == 8
    assert BaseTrainer._data_start(trainer, None, 0) == 0
    # a checkpoint saved on synthetic tokens: the rows of step 2 as if read from the start
    assert BaseTrainer._data_start(trainer, Resumed(Path("ck/step_2"), 2, {"kind": "synthetic"}), 2) == 8
    with pytest.raises(CheckpointError, match=r"^r\.yaml: dataset\.path: the data differ from those checkpoint "
                                              r"ck/step_2 was trained on \(packed sequences sha256 000000000000"):
        BaseTrainer._data_start(trainer, Resumed(Path("ck/step_2"), 2, {**saved, "fingerprint": "0" * 64}), 2)


@pytest.fixture
def world_one(monkeypatch):
    """A one-rank launch's environment; its gloo process group is torn down afterwards."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                           WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("case", sorted(BAD_DATASETS))
def test_the_trainer_refuses_a_bad_dataset_in_one_line_with_exit_code_2(tmp_path, capfd, world_one, case):
    dataset, broken, message = BAD_DATASETS[case]
    folder = bad_dataset_folder(tmp_path / "run", broken)
    recipe = corpus_recipe(folder, dataset, dp=1)
    assert trainer_main(["--config", str(recipe)]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"error: {recipe}: {message.format(folder=folder)}") and err.count("\n") == 1, err
    assert "Traceback" not in err
