import pytest

from tests.project_fixtures import make_project

# Tests that kill or stop runs, or assert that no run left a scratch folder behind: under
# pytest-xdist they share one worker, one after another, so no kill's cleanup window
# (a watcher removing the killed run's folder) is seen by another test's orphan check.
PROCESS_TESTS = frozenset({
    "tests/pipeline/test_bundle_integrity.py", "tests/pipeline/test_ownership.py",
    "tests/pipeline/test_bad_recipe_corpus.py", "tests/pipeline/test_kill_trials.py",
    "tests/codegen/test_launch_guard.py", "tests/verify/test_verify_silent_rank.py",
    "tests/trainer/test_checkpoint_kill.py",
})


# Modules whose tests share a costly module- or session-scoped fixture run on one worker,
# so the fixture is built once, not once per worker. Left out: modules whose fixture is
# cheap next to their tests, which the two workers should share.
SPLIT_MODULES = frozenset({"tests/families/test_family_subset.py"})


# tryfirst: pytest-xdist's own hook reads the marks into each test's id (``@group``), which
# is what --dist loadgroup schedules by; a mark added after it is ignored.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    no_gpu = _no_gpu_reason()
    for item in items:
        if no_gpu and item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=no_gpu))
        module = item.nodeid.split("::", 1)[0]
        if module in PROCESS_TESTS:
            item.add_marker(pytest.mark.xdist_group("processes"))
        elif module not in SPLIT_MODULES and (group := _shared_fixture_group(item, module)):
            item.add_marker(pytest.mark.xdist_group(group))
    # Slow modules first (a stable sort: each module stays in one piece, in its own order):
    # the workers then end on short tests together, not one on a minute-long test alone.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _shared_fixture_group(item, module: str) -> str | None:
    """The worker group of a test that uses a module- or session-scoped fixture defined in
    tests/ (pytest's own, such as tmp_path_factory, cost nothing to share): its module, or
    for a session fixture the fixture itself, which several modules may use."""
    info = getattr(item, "_fixtureinfo", None)
    scopes = {}
    for name, definitions in (info.name2fixturedefs.items() if info else ()):
        fixture = definitions[-1]
        if fixture.scope in ("module", "session") and fixture.baseid.startswith("tests"):
            scopes[fixture.scope] = f"{fixture.baseid}::{name}"
    return scopes.get("session") or (module if "module" in scopes else None)


@pytest.fixture
def project(tmp_path):
    """A fresh copy of dodo.py and recipes/ to build in."""
    return make_project(tmp_path / "project")


def _no_gpu_reason() -> str | None:
    """Why the ``gpu`` tests cannot run here (None: CUDA is present): pytest -ra prints it
    once per skipped test, and the summary line counts them."""
    import torch

    if torch.cuda.is_available():
        return None
    build = "a CPU build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no GPU found"
    return f"gpu: needs a CUDA GPU (torch {torch.__version__}, {build}); bench/gpu_check.sh runs these on one"
