"""The family sweep's training judge: strict at the first step; after it, a deviation from
one process passes only as far as one process itself moves when its gradients carry
rounding-sized noise (AdamW's own sensitivity, measured on the same model)."""

import pytest

from hyper_parallel.testing.family_case import compare_training, write_recipe
from hyper_parallel.testing.tiny_families import save_checkpoint
from hyper_parallel.trainer.reference import reference_training

pytestmark = pytest.mark.slow

REFERENCE = [{"loss": 5.0, "grad_norm": 10.0}, {"loss": 4.9, "grad_norm": 9.0}, {"loss": 4.8, "grad_norm": 8.0}]
# one process again, with rounding noise: step 1 identical, later steps off by 1e-4 / 5e-3
NOISY = [{"loss": 5.0, "grad_norm": 10.0}, {"loss": 4.9 * (1 + 1e-4), "grad_norm": 9.0 * (1 + 5e-3)},
         {"loss": 4.8, "grad_norm": 8.0 * (1 - 5e-3)}]


def run_with(step: int, loss_rel: float = 0.0, norm_rel: float = 0.0) -> list[dict]:
    """The reference with step ``step`` (1-based) moved by the given relative amounts."""
    records = [dict(record) for record in REFERENCE]
    records[step - 1]["loss"] *= 1 + loss_rel
    records[step - 1]["grad_norm"] *= 1 + norm_rel
    return records


def test_strict_without_a_noise_measurement():
    assert compare_training(run_with(3, norm_rel=5e-5), REFERENCE)[0] == "pass"
    status, reason = compare_training(run_with(3, norm_rel=2e-4), REFERENCE)
    assert status == "fail" and reason.startswith("train step 3:") and "(rel 2.0e-04)" in reason


def test_a_later_step_within_the_noise_passes_and_says_so():
    status, reason = compare_training(run_with(3, norm_rel=2e-4), REFERENCE, NOISY)
    assert status == "pass", reason
    assert "within AdamW's rounding noise" in reason and "grad norm rel 5e-03" in reason


def test_beyond_the_noise_fails_naming_both():
    status, reason = compare_training(run_with(2, norm_rel=1e-2), REFERENCE, NOISY)
    assert status == "fail" and reason.startswith("train step 2:")
    assert "one process with rounding noise: loss rel 1.0e-04, grad norm rel 5.0e-03" in reason
    assert compare_training(run_with(3, loss_rel=1e-3), REFERENCE, NOISY)[0] == "fail"


def test_the_first_step_stays_strict_whatever_the_noise():
    """No optimizer step precedes step 1: a wrong loss or gradient there is a fault."""
    loud = [dict(record, grad_norm=record["grad_norm"] * 1.5) for record in NOISY]
    loud[0] = dict(REFERENCE[0], grad_norm=REFERENCE[0]["grad_norm"] * 1.5)
    status, reason = compare_training(run_with(1, norm_rel=2e-4), REFERENCE, loud)
    assert status == "fail" and reason.startswith("train step 1:")


def test_reference_noise_starts_after_the_first_record(tmp_path):
    """On a real tiny model: the noisy reference's first step equals the plain one's (the
    noise enters after the record), later steps move, by far less than training does."""
    save_checkpoint("llama", tmp_path / "recipes" / "llama" / "model")
    recipe = write_recipe(tmp_path, "llama", "tp2")
    plain, noisy = reference_training(recipe), reference_training(recipe, rounding_noise=True)
    assert plain[0] == noisy[0]
    assert plain[1:] != noisy[1:]
    for have, ref in zip(noisy, plain):
        assert abs(have["grad_norm"] - ref["grad_norm"]) <= 1e-2 * ref["grad_norm"], (noisy, plain)


def test_a_norm_that_is_not_finite_fails_and_the_noise_widens_by_at_most_the_cap():
    nan = run_with(2)
    nan[1]["grad_norm"] = float("nan")
    assert compare_training(nan, REFERENCE)[0] == "fail"
    assert compare_training(nan, REFERENCE, NOISY)[0] == "fail"
    wild = [dict(record) for record in NOISY]
    wild[2]["loss"] *= 1.4  # an unstable noisy run: 40% is no rounding noise
    assert compare_training(run_with(3, loss_rel=0.3), REFERENCE, wild)[0] == "fail"
