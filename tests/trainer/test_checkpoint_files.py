"""The checkpoint folder's bookkeeping without ranks (which folders are complete,
partial, pruned) and the one-line errors of bad ``training.checkpoint`` values."""

import json

import pytest

from hyper_parallel.config import RecipeError, load_training_config
from hyper_parallel.trainer.checkpoint import (
    MARKER,
    CheckpointError,
    checkpoint_root,
    latest_complete,
    prune,
    remove_partial,
    scan,
)
from tests.project_fixtures import REPO, TINY_RECIPE


def _checkpoint(root, name, complete=True):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"x")
    if complete:
        (folder / MARKER).write_text(json.dumps({"step": 0}))
    return folder


def test_partial_checkpoints_are_ignored_and_removed(tmp_path):
    _checkpoint(tmp_path, "step_2")
    _checkpoint(tmp_path, "step_10")  # numeric order, not name order
    _checkpoint(tmp_path, "step_12", complete=False)  # killed before rank 0 marked it
    _checkpoint(tmp_path, "step_12.tmp-a1b2c3", complete=False)  # killed while the ranks wrote
    (tmp_path / "notes.txt").write_text("the user's")
    (tmp_path / "other").mkdir()
    complete, partial = scan(tmp_path)
    assert [step for step, _ in complete] == [2, 10]
    assert latest_complete(tmp_path) == tmp_path / "step_10"
    assert sorted(p.name for p in partial) == ["step_12", "step_12.tmp-a1b2c3"]
    remove_partial(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "other", "step_10", "step_2"]


def test_keep_last_removes_the_oldest_complete_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        _checkpoint(tmp_path, f"step_{step}")
    assert [p.name for p in prune(tmp_path, 2)] == ["step_1", "step_2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]
    assert prune(tmp_path, 0) == []  # 0 keeps every checkpoint
    assert latest_complete(tmp_path / "missing") is None


def _recipe(tmp_path, checkpoint: str):
    recipe = tmp_path / "recipe.yaml"
    model = REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"
    source = (REPO / TINY_RECIPE).read_text().replace("models/tiny-qwen3-moe", str(model))
    recipe.write_text(source.replace("  seed: 0\n", f"  seed: 0\n  checkpoint: {checkpoint}\n"))
    return recipe


def test_checkpoint_defaults_and_relative_dir(tmp_path):
    config = load_training_config(_recipe(tmp_path, "{dir: ckpt, async: true}"))
    settings = config.training.checkpoint
    assert (settings.every_steps, settings.keep_last, settings.async_, settings.resume) == (100, 3, True, True)
    assert checkpoint_root(config, "recipe.yaml") == tmp_path / "ckpt"  # relative to the recipe's folder
    assert checkpoint_root(load_training_config(_recipe(tmp_path, "{}")), "recipe.yaml") is None


@pytest.mark.parametrize("value, message", [
    ("{every_steps: 0, dir: c}", "training.checkpoint.every_steps: expected an integer >= 1, got 0; "
                                 "e.g. every_steps: 100 saves after steps 100, 200, ... and after the last step"),
    ("{keep_last: -1}", "training.checkpoint.keep_last: expected an integer >= 0 (0 keeps every checkpoint), got -1"),
    ("{dir: ''}", "training.checkpoint.dir: expected a folder path (relative to the recipe's folder), got an empty "
                  "string; name a folder, or leave training.checkpoint out to save no checkpoints"),
    ("{async: 'yes'}", "training.checkpoint.async: expected bool, got str 'yes'"),
    ("{every_step: 5}", "unknown key 'training.checkpoint.every_step'; expected one of async, dir, every_steps, "
                        "keep_last, resume"),
    ("{dir: [a]}", "training.checkpoint.dir: expected str, got list ['a']"),
])
def test_bad_checkpoint_values_are_one_line(tmp_path, value, message):
    recipe = _recipe(tmp_path, value)
    with pytest.raises(RecipeError) as info:
        load_training_config(recipe)
    assert str(info.value) == f"{recipe}: {message}"


def test_a_checkpoint_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "ckpt").write_text("")
    recipe = _recipe(tmp_path, "{dir: ckpt}")
    with pytest.raises(CheckpointError) as info:
        checkpoint_root(load_training_config(recipe), str(recipe))
    assert str(info.value) == (f"{recipe}: training.checkpoint.dir: {tmp_path / 'ckpt'} is a file; expected a folder "
                               f"for the checkpoints (relative paths start at the recipe's folder); fix "
                               f"training.checkpoint.dir")
