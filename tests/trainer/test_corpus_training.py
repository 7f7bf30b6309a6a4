"""Training on a JSON lines corpus under torchrun (gloo, CPU, dp2 with FSDP2, the hf
backend): what each rank feeds the model equals a direct tokenization of the documents,
packed with EOS between them and split disjointly by dp rank; a resumed run continues at
the recorded data position with the uninterrupted run's losses; and a checkpoint that does
not fit (another hidden size, another model's names) or is damaged (a shard file
deleted, truncated or overwritten, the metadata, the marker or an RNG file corrupt) is refused in one line naming the tensor or the file, exit code 2, the
checkpoint folder unchanged; so is a bad dataset.

One launch (a module fixture) makes the uninterrupted run, which feeds every test, and
then, in the same ranks, the resumed run in a copy of its folder; each of the other
launches copies its folder."""

import json
import math
import shutil

import pytest
import torch
import yaml

from hyper_parallel.trainer.checkpoint_check import (
    CheckpointMismatch,
    check_files,
    check_rng_files,
    check_shapes,
    load_failure,
    read_marker,
    read_metadata,
)
from tests.launch import assert_ran, torchrun
from tests.project_fixtures import REPO, tree_state
from tests.trainer.corpus_fixtures import (
    BAD_DATASETS,
    DOCUMENTS,
    EOS,
    bad_dataset_folder,
    corpus_recipe,
    model_with_tokenizer,
    write_jsonl,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

QWEN3_MOE_MODELING = "transformers.models.qwen3_moe.modeling_qwen3_moe"
SEQ_LEN, BATCH, STEPS = 12, 4, 4
RESUME_MARKER = "corpus_worker: the resumed run starts"  # printed by rank 0 between the two runs


def _ranks(out) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def _trainer(recipe):
    """``python -m hyper_parallel.trainer`` on two ranks, as a user launches it (from the
    folder above the recipe's: the pipeline's workspace must not overlap the bundle folder)."""
    return torchrun(["-m", "hyper_parallel.trainer", "--config", str(recipe)], recipe.parent.parent,
                    preload=(QWEN3_MOE_MODELING,))


def _run_and_resume(tmp_path_factory, name: str, dataset: dict):
    """A folder with the tiny model and its tokenizer, corpus.jsonl and the recipe on
    ``dataset``, trained 4 steps with checkpoints ``step_2`` and ``step_4``, then, in the same
    ranks, a copy of the folder without ``step_4`` resumed (tests/trainer/corpus_worker.py).
    Returns the folder, the whole run's output and per-rank results, the resumed run's."""
    folder = tmp_path_factory.mktemp(f"{name}_run")
    model_with_tokenizer(folder / "model")
    write_jsonl(folder / "corpus.jsonl")
    recipe = corpus_recipe(folder, {"kind": "jsonl", "path": "corpus.jsonl", "cache_dir": "tokens", **dataset},
                           training={"steps": STEPS,
                                     "checkpoint": {"dir": "checkpoints", "every_steps": 2, "keep_last": 0}})
    out, resumed_out = tmp_path_factory.mktemp(f"{name}_out"), tmp_path_factory.mktemp(f"{name}_resumed_out")
    proc = torchrun(["-m", "tests.trainer.corpus_worker", "--config", str(recipe), "--out", str(out),
                     "--resume-copy", str(tmp_path_factory.mktemp(f"{name}_resumed") / "run"),
                     "--drop", "checkpoints/step_4", "--resume-out", str(resumed_out),
                     "--marker", RESUME_MARKER], REPO, preload=(QWEN3_MOE_MODELING,))
    assert_ran(proc)
    whole_stdout, marker, resumed_stdout = proc.stdout.partition(RESUME_MARKER)
    assert marker, proc.stdout
    return folder, (whole_stdout, _ranks(out)), (resumed_stdout, _ranks(resumed_out))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The folder and per-rank results of the run on the token cache (in order), and the
    resumed run's output and per-rank results."""
    folder, (stdout, ranks), resumed = _run_and_resume(tmp_path_factory, "corpus", {"shuffle": False})
    assert "dataset: 30 documents" in stdout, stdout
    return folder, ranks, resumed


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """The same run with ``dataset.streaming: true`` (no token cache, rows read in order),
    and its resumed copy: per-rank results and the resumed run's output."""
    folder, (stdout, ranks), resumed = _run_and_resume(tmp_path_factory, "streamed", {"streaming": True})
    assert "dataset: streamed from 1 jsonl file(s)" in stdout, stdout
    assert not any(p.is_dir() for p in (folder / "tokens").iterdir())  # no cache entry, only the files' hashes
    return ranks, resumed


def _direct_rows(model_dir) -> tuple[list[list[int]], int]:
    """The documents tokenized one by one, EOS after each, cut into rows of SEQ_LEN; and EOS's id."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    stream = [t for text in DOCUMENTS for t in (*tokenizer(text, add_special_tokens=False)["input_ids"], eos)]
    return [stream[i:i + SEQ_LEN] for i in range(0, len(stream) - SEQ_LEN + 1, SEQ_LEN)], eos


def test_each_rank_trains_on_its_slice_of_the_packed_corpus(trained):
    folder, ranks, _ = trained
    rows, eos = _direct_rows(folder / "model")
    assert len(rows) >= STEPS * BATCH
    for rank, result in enumerate(ranks):
        assert result["steps"] == [1, 2, 3, 4]
        micro = [batch[0] for batch in result["inputs"]]  # micro_batch_size 1: one row each
        assert len(micro) == STEPS * 2
        # step s, dp rank r: rows 4s + 2r and 4s + 2r + 1 of the packed stream
        assert micro == [rows[4 * s + 2 * rank + m] for s in range(STEPS) for m in range(2)]
    both = [tuple(b[0]) for r in ranks for b in r["inputs"]]
    assert sorted(both) == sorted(tuple(r) for r in rows[:STEPS * BATCH])  # disjoint, and together every row
    trained_tokens = [t for row in both for t in row]
    # EOS between the documents: one per document ending in the trained rows (none dropped or added)
    assert trained_tokens.count(eos) == sum(row.count(eos) for row in rows[:STEPS * BATCH]) >= 10
    marker = json.loads((folder / "checkpoints" / "step_2" / "COMPLETE.json").read_text())
    assert marker["data"]["kind"] == "jsonl" and marker["data"]["next_step"] == 2
    assert marker["data"]["next_row"] == 2 * BATCH and marker["data"]["rows"] == len(rows)


def test_a_resumed_run_continues_at_the_data_position(trained):
    _, whole, (stdout, resumed) = trained  # the resumed run: a new trainer in the same ranks
    assert "resumed from checkpoint" in stdout and "(step 2)" in stdout, stdout
    for rank in (0, 1):
        assert resumed[rank]["steps"] == [3, 4]
        assert resumed[rank]["inputs"] == whole[rank]["inputs"][4:]  # steps 3 and 4: the same rows
        for got, want in zip(resumed[rank]["losses"], whole[rank]["losses"][2:]):
            assert math.isclose(got, want, rel_tol=1e-7), (resumed[rank]["losses"], whole[rank]["losses"])


def test_a_streamed_dataset_trains_on_the_cached_rows_and_resumes_exactly(trained, streamed):
    _, cached, _ = trained
    whole, (stdout, resumed) = streamed
    assert "rows to reach data position 8" in stdout, stdout  # the resumed run reads up to its position
    for rank in (0, 1):
        assert whole[rank]["inputs"] == cached[rank]["inputs"]  # the cache's rows, in order
        assert whole[rank]["losses"] == cached[rank]["losses"]
        assert resumed[rank]["steps"] == [3, 4] and resumed[rank]["inputs"] == whole[rank]["inputs"][4:]
        for got, want in zip(resumed[rank]["losses"], whole[rank]["losses"][2:]):
            assert math.isclose(got, want, rel_tol=1e-7), (resumed[rank]["losses"], whole[rank]["losses"])


def _refused(proc, line_start: str) -> str:
    """The launch failed with exit code 2 and one error line from rank 0, no rank's traceback."""
    assert proc.returncode != 0, proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(line_start), proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    assert "hyper_parallel/trainer" not in proc.stderr and "[rank" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


def test_a_checkpoint_of_another_config_names_the_tensor_and_both_shapes(trained, tmp_path):
    folder, _, _ = trained
    run = shutil.copytree(folder, tmp_path / "run")
    recipe = run / "recipe.yaml"
    data = yaml.safe_load(recipe.read_text())
    data["model"]["config_overrides"] = {"hidden_size": 32}
    data["training"]["steps"] = 6
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    before = tree_state(run / "checkpoints")
    line = _refused(_trainer(recipe), f"error: {recipe}: training.checkpoint.dir: checkpoint "
                                      f"{run / 'checkpoints' / 'step_4'} does not fit this recipe: tensor "
                                      f"model.model.embed_tokens.weight expected shape (256, 32), found (256, 64)")
    assert "nothing was changed" in line
    assert tree_state(run / "checkpoints") == before


def test_resuming_with_streaming_or_shuffle_switched_is_refused_naming_the_key(trained, tmp_path):
    folder, _, _ = trained
    run = shutil.copytree(folder, tmp_path / "run")
    recipe = run / "recipe.yaml"
    data = yaml.safe_load(recipe.read_text())
    data["training"]["steps"] = 6
    for change, line in (({"streaming": True}, "dataset.streaming: checkpoint {step} was trained with "
                                               "dataset.streaming: false, this run has true"),
                         ({"shuffle": True}, "dataset.shuffle: checkpoint {step} was trained with shuffle: false, "
                                             "this run has true: the rows after its data position would be others")):
        recipe.write_text(yaml.safe_dump({**data, "dataset": {**data["dataset"], **change}}, sort_keys=False))
        _refused(_trainer(recipe), f"error: {recipe}: " + line.format(step=run / "checkpoints" / "step_4"))


def test_a_missing_shard_file_is_named(trained, tmp_path):
    folder, _, _ = trained
    run = shutil.copytree(folder, tmp_path / "run")
    shard = run / "checkpoints" / "step_4" / "__1_0.distcp"
    shard.unlink()
    before = tree_state(run / "checkpoints")
    _refused(_trainer(run / "recipe.yaml"), f"error: {run / 'recipe.yaml'}: training.checkpoint.dir: checkpoint "
                                            f"shard file {shard} is missing")
    assert tree_state(run / "checkpoints") == before


def test_a_damaged_shard_or_metadata_file_is_named(trained, tmp_path):
    """The same checks in one process (the launch path is the test above's)."""
    folder, _, _ = trained
    step = shutil.copytree(folder / "checkpoints" / "step_4", tmp_path / "step_4")
    shard = step / "__0_0.distcp"
    damaged = bytearray(shard.read_bytes())  # same size, other bytes: only loading finds it
    damaged[64:len(damaged) // 2] = bytes(len(damaged) // 2 - 64)
    shard.write_bytes(bytes(damaged))
    check_files(read_metadata(step, "r.yaml"), step, "r.yaml")
    found = load_failure(step, RuntimeError("[rank0]: RuntimeError: not a ZIP archive"), "r.yaml")
    assert str(found).startswith(f"r.yaml: training.checkpoint.dir: checkpoint shard file {shard} is corrupt"), found
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointMismatch, match=f"checkpoint shard file {shard} is truncated \\(100 bytes"):
        check_files(read_metadata(step, "r.yaml"), step, "r.yaml")
    (step / "rng" / "rank_1.pt").write_bytes(b"\0" * 64)
    with pytest.raises(CheckpointMismatch, match=f"checkpoint file {step / 'rng' / 'rank_1.pt'} is corrupt"):
        check_rng_files(step, "r.yaml")
    (step / "COMPLETE.json").write_text("{")
    with pytest.raises(CheckpointMismatch, match=f"checkpoint file {step / 'COMPLETE.json'} cannot be read"):
        read_marker(step / "COMPLETE.json", "r.yaml")
    # another model's parameter names: the first one the checkpoint lacks is named
    other = {"model": {"lm_head.weight": torch.zeros(256, 64), "transformer.wte.weight": torch.zeros(256, 64)}}
    with pytest.raises(CheckpointMismatch, match=r"tensor model\.transformer\.wte\.weight \(shape \(256, 64\) "
                                                 r"here\) is not in the checkpoint"):
        check_shapes(other, read_metadata(step, "r.yaml"), step, "r.yaml")
    (step / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointMismatch, match=f"checkpoint file {step / '.metadata'} cannot be read"):
        read_metadata(step, "r.yaml")
    (step / ".metadata").unlink()
    with pytest.raises(CheckpointMismatch, match=f"{step / '.metadata'} is missing"):
        read_metadata(step, "r.yaml")



def test_a_bad_dataset_is_one_line_from_rank_0_and_every_rank_exits_2(tmp_path):
    """Under torchrun (each kind of bad dataset, in one process: tests/trainer/test_corpus.py)."""
    dataset, broken, message = BAD_DATASETS["column_missing"]
    folder = bad_dataset_folder(tmp_path / "run", broken)
    recipe = corpus_recipe(folder, dataset)
    before = tree_state(folder)
    _refused(_trainer(recipe), f"error: {recipe}: {message.format(folder=folder)}")
    assert tree_state(folder) == before
