"""verify's bounds: never more processes than the cap, never an unbounded simulated world,
and a cap that is not a positive integer is an error, not a default."""

import pytest

from hyper_parallel.codegen.check.verify_mode import (
    MAX_PROCS_ENV,
    MAX_SIMULATED_RANKS,
    VerifyError,
    max_processes,
    verify_mode,
)


def test_ranks_are_processes_up_to_the_cap_and_threads_above(monkeypatch):
    monkeypatch.setenv(MAX_PROCS_ENV, "4")
    assert max_processes() == 4
    assert verify_mode(4) == "torchrun"
    assert verify_mode(5) == "threads"
    assert verify_mode(MAX_SIMULATED_RANKS) == "threads"


def test_a_world_beyond_what_one_process_simulates_is_refused(monkeypatch):
    monkeypatch.setenv(MAX_PROCS_ENV, "4")
    with pytest.raises(VerifyError, match=f"world size {MAX_SIMULATED_RANKS + 1}: verify simulates at most"):
        verify_mode(MAX_SIMULATED_RANKS + 1)


@pytest.mark.parametrize("value", ["0", "-3", "abc", ""])
def test_a_cap_that_is_not_a_positive_integer_is_an_error(monkeypatch, value):
    monkeypatch.setenv(MAX_PROCS_ENV, value)
    with pytest.raises(VerifyError, match=f"{MAX_PROCS_ENV}: expected a positive integer"):
        max_processes()
