import pytest

from tests.project_fixtures import make_project

# Tests that kill or stop runs, or assert that no run left a scratch folder behind: under
# pytest-xdist they share one worker, one after another, so no kill's cleanup window
# (a watcher removing the killed run's folder) is seen by another test's orphan check.
PROCESS_TESTS = frozenset({
    "tests/pipeline/test_bundle_integrity.py", "tests/pipeline/test_ownership.py",
    "tests/pipeline/test_bad_recipe_corpus.py", "tests/pipeline/test_kill_trials.py",
    "tests/codegen/test_launch_guard.py", "tests/verify/test_verify_silent_rank.py",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("::", 1)[0] in PROCESS_TESTS:
            item.add_marker(pytest.mark.xdist_group("processes"))


@pytest.fixture
def project(tmp_path):
    """A fresh copy of dodo.py and recipes/ to build in."""
    return make_project(tmp_path / "project")
