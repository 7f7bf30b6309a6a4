"""``python -m hyper_parallel.trainer`` outside torchrun or with a bad recipe: one clear
line naming the recipe and the fix, exit status 2, no traceback."""

import sys

from tests.project_fixtures import REPO, TINY_RECIPE, run


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
