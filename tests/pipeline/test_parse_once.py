"""The recipe is parsed once per process (issue 13): a CLI generate, as one process or
as each rank under torchrun, and a doit run read the YAML once; the preflight's ranks
are processes of their own and parse it once each."""

import runpy

import pytest
import yaml

from hyper_parallel.codegen import cli
from hyper_parallel.config import loading
from tests.project_fixtures import TINY_RECIPE, make_project

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LAUNCH_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@pytest.fixture
def recipe_parses(monkeypatch):
    """The recipes parsed in this process from now on (the one YAML parse of the loader)."""
    parsed = []
    real_load = yaml.load

    def counting_load(stream, Loader):  # noqa: N803 (yaml's own keyword)
        if Loader is loading._RecipeLoader:
            parsed.append(stream)
        return real_load(stream, Loader=Loader)

    monkeypatch.setattr(loading.yaml, "load", counting_load)
    return parsed


@pytest.fixture
def built(tmp_path, monkeypatch):
    """A project whose tiny recipe a first in-process CLI generate builds; this process
    runs in it, outside any launch."""
    project = make_project(tmp_path / "project")
    monkeypatch.chdir(project)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    return project


def test_a_generate_parses_the_recipe_once_in_every_front_door(built, monkeypatch, recipe_parses):
    assert cli.main(["generate", "--config", TINY_RECIPE]) == 0  # every stage, preflight included
    assert len(recipe_parses) == 1, recipe_parses

    for rank in ("0", "1"):  # under torchrun: rank 0 reuses the bundle, rank 1 waits for it
        recipe_parses.clear()
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        assert cli.main(["generate", "--config", TINY_RECIPE]) == 0
        assert len(recipe_parses) == 1, (rank, recipe_parses)
    for key in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key)

    from doit.cmd_base import ModuleTaskLoader
    from doit.doit_cmd import DoitMain

    recipe_parses.clear()
    dodo = runpy.run_path("dodo.py")
    assert DoitMain(ModuleTaskLoader(dodo)).run(["generate", f"config={TINY_RECIPE}"]) == 0  # every stage checked
    assert len(recipe_parses) == 1, recipe_parses


def test_a_model_build_projects_the_recipe_once(built, monkeypatch):
    """HyperAutoModel projects the recipe into its spec once per build (reading config.json
    and the source once), and hands that spec to the HF config, the bundle's preparation
    and the runtime planner, for every backend."""
    import dataclasses

    from hyper_parallel.codegen.spec import project
    from hyper_parallel.config import load_training_config
    from hyper_parallel.models.hf.auto_model import HyperAutoModel

    assert cli.main(["generate", "--config", TINY_RECIPE]) == 0
    projections = []
    real = project.CodegenSpec

    def counting(*args, **kwargs):  # every projection ends in this constructor, however it was imported
        projections.append(kwargs.get("recipe_path"))
        return real(*args, **kwargs)

    monkeypatch.setattr(project, "CodegenSpec", counting)
    config = load_training_config(TINY_RECIPE)
    assert config.codegen
    HyperAutoModel.from_pretrained(config)  # gen: reuses the bundle, preflights and imports it
    assert len(projections) == 1, projections
    projections.clear()
    HyperAutoModel.from_config(dataclasses.replace(config, codegen=False, modeling_backend="hf"))
    assert len(projections) == 1, projections
