"""training.lr_schedule and training.eval (issue 28): the multiplier's shape; under
torchrun the trainer's per-step lr, losses and eval losses equal the single-process
reference's (hyper_parallel/trainer/reference.py applies the same schedule and evaluation);
a resumed run with a schedule is bitwise the uninterrupted one; a tokenized dataset's
held-out rows are never trained on."""

import json
import math
import shutil

import pytest
import torch
import transformers
import yaml
from safetensors.torch import save_file

from hyper_parallel.config.schema import LrScheduleConfig, TrainingConfig
from hyper_parallel.trainer.metrics import read_metrics
from hyper_parallel.trainer.reference import reference_training
from hyper_parallel.trainer.schedule import lr_multiplier
from tests.launch import assert_ran, torchrun
from tests.project_fixtures import REPO, TINY_RECIPE, make_project
from tests.trainer.corpus_fixtures import corpus_recipe, model_with_tokenizer, write_jsonl

QWEN3_MOE_MODELING = "transformers.models.qwen3_moe.modeling_qwen3_moe"
STEPS = 6


def _training(**schedule) -> TrainingConfig:
    return TrainingConfig(steps=10, lr_schedule=LrScheduleConfig(**schedule))


def test_warmup_reaches_lr_then_each_decay_ends_at_its_floor():
    warm = [lr_multiplier(n, _training(warmup_steps=4, decay="constant")) for n in range(1, 11)]
    assert warm == [0.25, 0.5, 0.75, 1.0] + [1.0] * 6
    cosine = [lr_multiplier(n, _training(warmup_steps=2, decay="cosine", min_lr_ratio=0.1)) for n in range(1, 11)]
    assert cosine[:2] == [0.5, 1.0] and cosine[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(cosine[1:], cosine[2:]))  # falls every step after the warmup
    assert cosine[5] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))
    linear = [lr_multiplier(n, _training(decay="linear", min_lr_ratio=0.0)) for n in range(1, 11)]
    assert linear == pytest.approx([1 - n / 10 for n in range(1, 11)])
    assert [lr_multiplier(n, _training()) for n in range(1, 11)] == [1.0] * 10  # the default: constant


def _save_weights(model_dir) -> None:
    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(model_dir / "model.safetensors"))


SCHEDULE = {"warmup_steps": 2, "decay": "cosine", "min_lr_ratio": 0.1}


def _synthetic_recipe(project, name: str, checkpoint: str) -> tuple[str, str]:
    data = yaml.safe_load((project / TINY_RECIPE).read_text())
    data.update(codegen=False, modeling_backend="hf")
    data["model"]["init"] = "pretrained"
    data["accelerator"].update(nproc_per_node=2, dp_size=2, tp_size=1)  # FSDP2: eval averaged over dp
    data["training"].update(steps=STEPS, global_batch_size=4, micro_batch_size=2, seq_len=12,
                            lr_schedule=SCHEDULE, eval={"every_steps": 4, "batches": 2},
                            checkpoint={"dir": checkpoint, "every_steps": 3, "keep_last": 0})
    path = (project / TINY_RECIPE).with_name(f"{name}.yaml")
    return str(path), yaml.safe_dump(data, sort_keys=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One world-2 launch: the synthetic recipe whole (checkpoints at 3 and 6), the same
    recipe resumed from the copy of its step-3 checkpoint, and a tokenized one with eval."""
    tmp = tmp_path_factory.mktemp("schedule")
    project = make_project(tmp / "project")
    _save_weights(project / "recipes/tiny_cpu/models/tiny-qwen3-moe")
    folder = project / "recipes/tiny_cpu"
    corpus = tmp / "corpus"
    corpus.mkdir()
    model_with_tokenizer(corpus / "model")
    _save_weights(corpus / "model")
    write_jsonl(corpus / "corpus.jsonl")
    tokenized = corpus_recipe(corpus, {"kind": "jsonl", "path": "corpus.jsonl"}, dp=2, training={
        "lr_schedule": {"warmup_steps": 1, "decay": "linear"}, "eval": {"every_steps": 2, "batches": 1},
        "checkpoint": {"dir": "ck", "every_steps": 4}})
    text = tokenized.read_text().replace("  init: random\n", "  init: pretrained\n")
    chain = [
        {"name": "whole", "recipe": _synthetic_recipe(project, "whole", "ck_whole")[0],
         "text": _synthetic_recipe(project, "whole", "ck_whole")[1], "copies": []},
        {"name": "resumed", "recipe": _synthetic_recipe(project, "resumed", "ck_resumed")[0],
         "text": _synthetic_recipe(project, "resumed", "ck_resumed")[1],
         "copies": [[str(folder / "ck_whole/step_3"), str(folder / "ck_resumed/step_3")]]},
        {"name": "tokenized", "recipe": str(tokenized), "text": text, "copies": []},
    ]
    for run in chain:
        run["metrics"] = str(tmp / f"{run['name']}.jsonl")
    (tmp / "chain.json").write_text(json.dumps(chain))
    proc = torchrun(["-m", "tests.trainer.train_chain_worker", "--chain", str(tmp / "chain.json")], project,
                    nproc=2, preload=(QWEN3_MOE_MODELING,), env={"PYTHONPATH": str(REPO)})
    assert_ran(proc)
    metrics = {run["name"]: read_metrics(run["metrics"]) for run in chain}
    return metrics, chain, proc.stdout, corpus


@pytest.mark.slow
@pytest.mark.distributed
def test_the_trainer_follows_the_schedule_and_evaluates_like_one_process(runs):
    metrics, chain, _, _ = runs
    want = reference_training(chain[0]["recipe"])
    got = metrics["whole"]
    assert [r["lr"] for r in got] == pytest.approx([1e-3 * lr_multiplier(n, TrainingConfig(
        steps=STEPS, lr_schedule=LrScheduleConfig(**SCHEDULE))) for n in range(1, STEPS + 1)], rel=1e-12)
    assert [r["step"] for r in got if r["eval_loss"] is not None] == [4, 6]  # every 4 steps and the last
    for a, b in zip(got, want):
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (got, want)
        if a["eval_loss"] is not None:
            assert math.isclose(a["eval_loss"], b["eval_loss"], rel_tol=1e-5), (a, b)
    assert got[3]["eval_loss"] != got[5]["eval_loss"]  # the model changed between evaluations


@pytest.mark.slow
@pytest.mark.distributed
def test_a_resumed_run_with_a_schedule_is_bitwise_the_whole_run(runs):
    metrics, _, _, _ = runs
    whole = {r["step"]: r for r in metrics["whole"]}
    resumed = metrics["resumed"]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for record in resumed:
        for key in ("loss", "grad_norm", "lr", "eval_loss"):
            assert record[key] == whole[record["step"]][key], (key, record, whole[record["step"]])


@pytest.mark.slow
@pytest.mark.distributed
def test_a_tokenized_dataset_holds_out_its_eval_rows(runs):
    metrics, chain, stdout, corpus = runs
    assert "training.eval: 4 of " in stdout and "packed rows, drawn at random" in stdout
    complete = json.loads((corpus / "ck" / "step_4" / "COMPLETE.json").read_text())
    want = reference_training(chain[2]["recipe"])
    assert complete["data"]["rows"] == want_rows(chain[2]["recipe"]) - 4  # training's epoch excludes them
    got = metrics["tokenized"]
    for a, b in zip(got, want):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (got, want)
        if a["eval_loss"] is not None:
            assert math.isclose(a["eval_loss"], b["eval_loss"], rel_tol=1e-5), (a, b)
    assert [r["step"] for r in got if r["eval_loss"] is not None] == [2, 4]
    shutil.rmtree(corpus / "ck")


def want_rows(recipe: str) -> int:
    """The packed rows of the whole dataset (before the hold-out)."""
    from hyper_parallel.config import load_training_config
    from hyper_parallel.models.hf.model_builder import recipe_model_dir
    from hyper_parallel.trainer.corpus import prepare_corpus

    config = load_training_config(recipe)
    return prepare_corpus(config.dataset, config.training, recipe_model_dir(config), recipe, log=False).num_rows



def test_the_held_out_rows_are_a_fixed_random_sample_never_trained_on():
    """Spread over the corpus (not its tail: the last files of a folder), the same whatever
    training.seed is, disjoint from the training rows, which keep their order."""
    from types import SimpleNamespace

    from hyper_parallel.trainer.corpus import PackedCorpus
    from hyper_parallel.trainer.evaluation import hold_out

    rows = torch.arange(200 * 3, dtype=torch.int32).reshape(200, 3)  # row r starts with token 3r
    corpus = PackedCorpus(rows, documents=5, fingerprint="f")

    def split(seed: int):
        training = SimpleNamespace(global_batch_size=4, seed=seed, eval=SimpleNamespace(batches=5))
        return hold_out(corpus, SimpleNamespace(training=training, where="r.yaml"))

    (train, held), (_, held_again) = split(0), split(1)
    assert held.shape == (20, 3) and torch.equal(held, held_again)
    held_ids = set((held[:, 0] // 3).tolist())
    train_ids = (train.take(torch.arange(train.num_rows))[:, 0] // 3).tolist()
    assert held_ids.isdisjoint(train_ids) and len(train_ids) == 180 and train_ids == sorted(train_ids)
    assert min(held_ids) < 100 and max(held_ids) >= 100  # from both halves, not the last 20 rows
    assert train.fingerprint != corpus.fingerprint
