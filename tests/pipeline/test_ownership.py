"""Ownership: install and clean act only on folders codegen wrote, proven by the bundle's
own manifest; links are refused; recipe ids are one-to-one. Each bad case exits 2 with a
message naming the folder and what is in the way, and leaves the project and every folder
outside it byte-identical (a link's target included)."""

import shutil

import pytest
import yaml

from hyper_parallel.codegen.manager import clean_recipe, load_spec, run_pipeline
from tests.pipeline.pipeline_helpers import BUNDLE, ENV, MODELING_FILE, copy_project, generated_tiny_project
from tests.project_fixtures import TINY_RECIPE, cli, orphaned_scratch, tree_state

WORKSPACE = "generated/recipes+tiny_cpu+qwen3_moe_tiny"


@pytest.fixture
def project(tmp_path_factory, tmp_path):
    return copy_project(generated_tiny_project(tmp_path_factory), tmp_path / "project")


def _outside(tmp_path):
    """A folder of the user's, outside the project: a link may point at it."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work\n")
    (folder / "modeling_mine.py").write_text("X = 1\n")
    return folder


def _edit_recipe(project, **model_keys):
    recipe = project / TINY_RECIPE
    data = yaml.safe_load(recipe.read_text())
    data["model"].update(model_keys)
    data["accelerator"]["sequence_parallel"] = True  # a change that needs a new bundle installed
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))


def _bundle_link(project, tmp_path):
    shutil.rmtree(project / BUNDLE)
    (project / BUNDLE).symlink_to(_outside(tmp_path), target_is_directory=True)
    return ["model.codegen_artifact_dir", "is a symbolic link", "outside", "replace the link by a folder"]


def _workspace_link(project, tmp_path):
    shutil.rmtree(project / WORKSPACE)
    (project / WORKSPACE).symlink_to(_outside(tmp_path), target_is_directory=True)
    return ["the recipe's workspace", "is a symbolic link", "outside"]


def _user_file_in_bundle(project, tmp_path):
    (project / BUNDLE / "NOTES.md").write_text("my notes\n")
    _edit_recipe(project)
    return ["cannot install the bundle at", "holds 1 file(s) codegen did not write (NOTES.md)", "nothing was changed"]


def _user_package_as_bundle(project, tmp_path):
    package = project / "recipes/tiny_cpu/mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("from .modeling_mine import *\n")
    (package / "modeling_mine.py").write_text("X = 1\n")
    _edit_recipe(project, codegen_artifact_dir="mypkg")
    return ["cannot install the bundle at", "mypkg", "codegen did not write (__init__.py, modeling_mine.py)"]


def _link_inside_bundle(project, tmp_path):
    (project / BUNDLE / "data").symlink_to(_outside(tmp_path), target_is_directory=True)
    _edit_recipe(project)
    return ["codegen did not write (data (a symbolic link))"]


def _folder_inside_bundle(project, tmp_path):
    (project / BUNDLE / "checkpoints").mkdir()
    (project / BUNDLE / "checkpoints" / "step_10.pt").write_bytes(b"\0" * 64)
    _edit_recipe(project)
    return ["codegen did not write (checkpoints/)"]


def _recipe_too_large(project, tmp_path):
    recipe = project / TINY_RECIPE
    recipe.write_text(recipe.read_text() + "# padding\n" * 120_000)
    return ["bytes; a recipe may have at most 1048576"]


CASES = {"bundle_folder_is_a_link": _bundle_link, "workspace_is_a_link": _workspace_link,
         "user_file_in_bundle": _user_file_in_bundle, "user_package_as_bundle": _user_package_as_bundle,
         "link_inside_bundle": _link_inside_bundle, "folder_inside_bundle": _folder_inside_bundle,
         "recipe_too_large": _recipe_too_large}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", ["generate", "clean"])
def test_refused_and_nothing_changed(project, tmp_path, case, command):
    fragments = CASES[case](project, tmp_path)
    if command == "clean" and case in ("user_package_as_bundle",):
        fragments = ["cannot remove the bundle at", "mypkg", "codegen did not write (__init__.py, modeling_mine.py)"]
    elif command == "clean" and fragments[0] == "cannot install the bundle at":
        fragments = ["cannot remove the bundle at", *fragments[1:]]
    before, outside = tree_state(project), tree_state(tmp_path / "outside") if (tmp_path / "outside").is_dir() else {}

    proc = cli(project, command, "--config", TINY_RECIPE, *(["--skip-preflight"] if command == "generate" else []),
               env=ENV)

    assert proc.returncode == 2, proc.stdout + proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, f"{fragment!r} not in {proc.stderr}"
    assert "Traceback" not in proc.stderr
    assert tree_state(project) == before
    if outside:
        assert tree_state(tmp_path / "outside") == outside
    assert orphaned_scratch() == []


def test_an_edited_listed_file_and_pycache_are_codegens(project):
    """The manifest proves a name is codegen's; an edited copy (generate rewrites it) and
    Python's own bytecode cache do not make the folder someone else's."""
    modeling = project / BUNDLE / MODELING_FILE
    original = modeling.read_bytes()
    modeling.write_bytes(original + b"\n# edited by hand\n")
    (project / BUNDLE / "__pycache__").mkdir()
    (project / BUNDLE / "__pycache__" / "modeling.cpython-311.pyc").write_bytes(b"\0" * 16)
    proc = cli(project, "generate", "--config", TINY_RECIPE, "--skip-preflight", env=ENV)
    assert proc.returncode == 0, proc.stderr
    assert modeling.read_bytes() == original
    assert not (project / BUNDLE / "__pycache__").exists()


def test_recipe_ids_are_one_to_one(project):
    """``tiny_cpu/q.yaml`` and ``tiny_cpu__q.yaml`` once shared a workspace: cleaning one
    removed the other's. Now each has its own; cleaning one leaves the other."""
    source = (project / TINY_RECIPE).read_text()
    nested = project / "recipes/tiny_cpu/q.yaml"
    flat = project / "recipes/tiny_cpu__q.yaml"
    nested.write_text(source)
    flat.write_text(source.replace("models/tiny-qwen3-moe", "tiny_cpu/models/tiny-qwen3-moe"))
    specs = [load_spec(path, project / "generated") for path in (nested, flat)]
    assert specs[0].workspace != specs[1].workspace, specs[0].workspace
    for spec in specs:
        run_pipeline(spec, ["resolve"])
    clean_recipe(specs[0], what=("workspace",))
    assert not specs[0].workspace.exists()
    assert (specs[1].workspace / "source.json").is_file()


def test_clean_refuses_a_workspace_holding_other_files(project):
    (project / WORKSPACE / "my_results.csv").write_text("1,2,3\n")
    before = tree_state(project)
    proc = cli(project, "clean", "--config", TINY_RECIPE, env=ENV)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cannot remove the workspace" in proc.stderr and "my_results.csv" in proc.stderr, proc.stderr
    assert tree_state(project) == before
