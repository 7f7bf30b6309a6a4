import pytest

from tests.project_fixtures import make_project


@pytest.fixture
def project(tmp_path):
    """A fresh copy of dodo.py and recipes/ to build in."""
    return make_project(tmp_path / "project")
