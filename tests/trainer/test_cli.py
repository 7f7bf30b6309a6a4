"""``python -m hyper_parallel.trainer`` outside torchrun or with a bad recipe: one clear
line naming the recipe and the fix, exit status 2, no traceback."""

import sys

import pytest

from tests.project_fixtures import REPO, TINY_RECIPE, run

pytestmark = pytest.mark.slow


def test_without_torchrun_it_says_how_to_launch():
    proc = run([sys.executable, "-m", "hyper_parallel.trainer", "--config", TINY_RECIPE], cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        f"error: {TINY_RECIPE}: the trainer runs under torchrun (this recipe needs 2 process(es) per node); "
        f"run: python -m torch.distributed.run --nproc_per_node=2 -m hyper_parallel.trainer --config {TINY_RECIPE}")


def test_a_bad_recipe_is_one_line(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model:\n  pretrained_model_name_or_path: m\ntraining:\n  steps: 0\n")
    proc = run([sys.executable, "-m", "hyper_parallel.trainer", "--config", str(recipe)], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {recipe}: training.steps: expected an integer >= 1, got 0"


def _bytes_dataset_recipe(tmp_path, path: str):
    recipe = tmp_path / "text.yaml"
    source = (REPO / TINY_RECIPE).read_text().replace("models/tiny-qwen3-moe", str(REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"))
    recipe.write_text(source + f"\ndataset:\n  kind: bytes\n  path: {path}\n")
    return recipe


def test_a_missing_bytes_dataset_is_one_line_from_rank_0_only(tmp_path):
    """Checked before any rank builds a model: rank 0 says it once, the others leave quietly."""
    recipe = _bytes_dataset_recipe(tmp_path, "corpus/missing.txt")
    outputs = {}
    for rank in ("0", "1"):
        proc = run([sys.executable, "-m", "hyper_parallel.trainer", "--config", str(recipe)], cwd=tmp_path,
                   env={"RANK": rank, "WORLD_SIZE": "2", "LOCAL_RANK": rank}, timeout=120)
        assert proc.returncode == 2, proc.stderr
        outputs[rank] = proc.stderr.strip()
    assert outputs["0"] == (f"error: {recipe}: dataset.path: {tmp_path / 'corpus/missing.txt'} does not exist "
                            f"(relative paths start at the recipe's folder); fix dataset.path")
    assert outputs["1"] == ""


def test_a_bytes_dataset_that_is_a_folder_is_named(tmp_path):
    (tmp_path / "corpus").mkdir()
    recipe = _bytes_dataset_recipe(tmp_path, "corpus")
    proc = run([sys.executable, "-m", "hyper_parallel.trainer", "--config", str(recipe)], cwd=tmp_path,
               env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {recipe}: dataset.path: {tmp_path / 'corpus'} is not a file; expected a local file"


def test_a_recipe_path_that_is_a_folder_is_one_line(tmp_path):
    proc = run([sys.executable, "-m", "hyper_parallel.codegen", "generate", "--config", str(tmp_path)], cwd=tmp_path,
               timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {tmp_path}: is a folder; expected a recipe YAML file "
                                   f"(e.g. {tmp_path / 'recipe.yaml'})")


def test_help_imports_no_torch_and_names_every_subcommand():
    """``--help`` answers before torch is imported (seconds of import; issue 56) and its usage
    line names the subcommands."""
    probe = ("import runpy, sys\nsys.argv = ['hyper_parallel.trainer', '--help']\ntry:\n"
             "    runpy.run_module('hyper_parallel.trainer', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print('torch imported' if 'torch' in sys.modules else 'no torch')\n")
    proc = run([sys.executable, "-c", probe], cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("no torch"), proc.stdout[-500:]
    assert "{export,plot,prepare-data,dry-run}" in proc.stdout
