"""The suite's pytest-xdist groups take effect: the tests that kill runs or check for
orphaned scratch share the ``processes`` worker, and a test that uses a costly shared
fixture runs on that fixture's worker (tests/conftest.py). Under ``--dist loadgroup``
xdist schedules by the ``@group`` suffix it writes into each test's id when it reads the
marks, so a mark added after that is silently ignored: this checks the ids themselves."""

import pytest

from tests.conftest import PROCESS_TESTS


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


def _group_ids_apply(config) -> bool:
    """Whether this is an xdist worker of a --dist loadgroup run (the option xdist reads)."""
    return bool(config.getvalue("loadgroup"))


def test_process_tests_share_the_processes_worker(request):
    items = [item for item in request.session.items if _module(item) in PROCESS_TESTS]
    for item in items:
        assert item.get_closest_marker("xdist_group").args == ("processes",), item.nodeid
        if _group_ids_apply(request.config):
            assert item.nodeid.endswith("@processes"), item.nodeid


def test_a_shared_module_fixture_keeps_its_tests_on_one_worker(request):
    items = [item for item in request.session.items if _module(item) == "tests/pipeline/test_incremental.py"
             and "built" in item.fixturenames]
    for item in items:
        assert item.get_closest_marker("xdist_group").args == ("tests/pipeline/test_incremental.py",), item.nodeid
        if _group_ids_apply(request.config):
            assert item.nodeid.endswith("@tests/pipeline/test_incremental.py"), item.nodeid


@pytest.mark.parametrize("fixture", ["family_results"])
def test_a_shared_session_fixture_keeps_its_users_on_one_worker(request, fixture):
    groups = {item.get_closest_marker("xdist_group").args for item in request.session.items
              if fixture in getattr(item, "fixturenames", ())}
    assert len(groups) <= 1, groups
