"""The bad-recipe corpus (tests/data/bad_recipes/): every recipe there is rejected by
``generate`` with a message naming the file, the key or module at fault, and what was
expected and found; exit code 2, no traceback; nothing on disk changed: the installed
bundle, the workspace and every other file of the project stay byte-identical, and no
scratch folder is left.

Each bad recipe is copied into recipes/tiny_cpu/ of one generated tiny project, beside
the good recipe, so it would install into the same recipes/tiny_cpu/generated/ bundle.
``expected.yaml`` lists the substrings each error must contain, split by where the
recipe is rejected: cases rejected before the derive stage run the real CLI as a
subprocess (cheap: no torch); cases the planner rejects run the same ``main()`` in this
process, so torch is imported once for all of them.

The helpers here are shared with test_bad_input.py (the cases that don't fit a corpus).
"""

import shutil
from pathlib import Path

import pytest
import yaml

from hyper_parallel.codegen import cli as codegen_cli
from tests.pipeline.pipeline_helpers import BUNDLE, ENV, copy_project, generated_tiny_project
from tests.project_fixtures import TINY_RECIPE, bundle_bytes, cli, orphaned_scratch, tree_state

CORPUS = Path(__file__).resolve().parents[1] / "data" / "bad_recipes"
EXPECTED = yaml.safe_load((CORPUS / "expected.yaml").read_text(encoding="utf-8"))
TINY_DIR = Path(TINY_RECIPE).parent
MIN_CASES = 90


@pytest.fixture(scope="module")
def installed_project(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    """A copy of the generated tiny project, the corpus' broken model folders beside the
    good one, and the installed bundle's bytes before any bad recipe ran."""
    project = copy_project(generated_tiny_project(tmp_path_factory),
                           tmp_path_factory.mktemp("bad_recipes") / "project")
    shutil.copytree(CORPUS / "models", project / TINY_DIR / "models", dirs_exist_ok=True)
    # A remote-code model folder (auto_map) for the trust cases: the suite's fused decoder.
    shutil.copytree(CORPUS.parent / "remote_code" / "fused_decoder", project / TINY_DIR / "models" / "remote-untrusted",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return project, bundle_bytes(project / BUNDLE)


def place_recipe(project: Path, name: str) -> str:
    """Copy corpus recipe ``name`` into the tiny recipe's folder; return its project path."""
    shutil.copy(CORPUS / name, project / TINY_DIR / name)
    return (TINY_DIR / name).as_posix()


def assert_names_the_problem(err: str, fragments: list[str]) -> None:
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in:\n{err}"
    assert "Traceback" not in err, err


def assert_bundle_untouched(project: Path, before: dict[str, bytes]) -> None:
    """Same files, same bytes, and no staging folder left beside the bundle."""
    assert bundle_bytes(project / BUNDLE) == before
    leftovers = [p.name for p in (project / BUNDLE).parent.iterdir() if p.name.startswith(".hp-bundle-")]
    assert leftovers == []


def assert_nothing_changed(project: Path, before: dict[str, bytes], tree: dict) -> None:
    """The bundle as installed, every file of the project (its workspace too) as it was,
    no scratch folder of a dead run left."""
    assert_bundle_untouched(project, before)
    after = tree_state(project)
    changed = sorted(k for k in set(tree) | set(after) if tree.get(k) != after.get(k))
    assert changed == [], changed
    assert orphaned_scratch() == []


def test_corpus_index_lists_every_recipe_once():
    on_disk = {p.name for p in CORPUS.glob("*.yaml")} - {"expected.yaml"}
    early, derive = set(EXPECTED["before_derive"]), set(EXPECTED["derive"])
    assert early.isdisjoint(derive)
    assert early | derive == on_disk
    assert len(on_disk) >= MIN_CASES
    for name, fragments in {**EXPECTED["before_derive"], **EXPECTED["derive"]}.items():
        assert name in fragments, f"{name}: the expected substrings must include the file name"


@pytest.mark.parametrize("name", sorted(EXPECTED["before_derive"]))
def test_rejected_before_derive(installed_project, name):
    project, before = installed_project
    recipe = place_recipe(project, name)

    tree = tree_state(project)

    proc = cli(project, "generate", "--config", recipe, "--skip-preflight", env=ENV)

    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_names_the_problem(proc.stderr, EXPECTED["before_derive"][name])
    assert_nothing_changed(project, before, tree)


@pytest.mark.parametrize("name", sorted(EXPECTED["derive"]))
def test_rejected_by_derive(installed_project, name, monkeypatch, capsys):
    project, before = installed_project
    recipe = place_recipe(project, name)
    monkeypatch.chdir(project)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)

    tree = tree_state(project)

    rc = codegen_cli.main(["generate", "--config", recipe, "--skip-preflight"])

    assert rc == 2
    assert_names_the_problem(capsys.readouterr().err, EXPECTED["derive"][name])
    assert_nothing_changed(project, before, tree)
