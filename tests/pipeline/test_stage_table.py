"""The stage table is the one list of stages (issue 13): the stage functions, the doit
tasks and dodo.py derive from it; the implementation hash covers exactly its parts."""

import runpy
import shutil

import pytest

from hyper_parallel.codegen import hash as hashing, stages
from hyper_parallel.codegen.hash import ImplementationPartMissing, implementation_sha256, part_modules, runner_parts
from hyper_parallel.codegen.stage_table import (
    STAGE_TABLE,
    STAGES,
    WORKSPACE_DIR,
    WORKSPACE_ENTRIES,
    Stage,
    check_table,
)
from hyper_parallel.codegen.spec.project import SPEC_FACTS
from tests.project_fixtures import REPO, TINY_RECIPE


def test_every_stage_has_a_runner_known_facts_and_existing_implementation():
    for row in STAGE_TABLE:
        assert callable(stages.stage_runner(row.name)), row.name
        assert set(row.facts) <= set(SPEC_FACTS), row.name
        for part in row.dynamic:
            assert part_modules(part), (row.name, part)  # raises when the part is missing
        assert "codegen/stages.py" in runner_parts(row.runner, row.dynamic), row.name


def test_workspace_entries_are_the_table_records_and_the_staged_folder():
    records = {row.output for row in STAGE_TABLE if not row.in_bundle}
    assert WORKSPACE_ENTRIES == records | {"staged", "signatures.json", "replaced_bundle.json"}
    install = next(row for row in STAGE_TABLE if row.in_bundle)
    assert (install.name, install.output_name) == ("install", "codegen_meta.json")


def test_doit_tasks_follow_the_table(project, monkeypatch):
    """file_dep: the records of the stages a stage reads; task_dep: the stage before;
    doc: the row's; a creator per row in dodo.py, documented by the row."""
    monkeypatch.chdir(project)
    from hyper_parallel.codegen import doit_tasks  # here: its import readies ./generated for doit's state

    monkeypatch.setattr(doit_tasks, "get_var", lambda name: TINY_RECIPE if name == "config" else None)
    rid = "recipes+tiny_cpu+qwen3_moe_tiny"
    for index, row in enumerate(STAGE_TABLE):
        (task,) = doit_tasks.stage_tasks(row.name)
        reads = [STAGE_TABLE[STAGES.index(name)] for name in row.reads]
        assert task["doc"] == row.doc
        assert task["file_dep"] == [f"{WORKSPACE_DIR}/{rid}/{r.output}" for r in reads if not r.in_bundle]
        assert task["task_dep"] == ([f"{STAGES[index - 1]}:{rid}"] if index else [])
        read_later = any(row.name in other.reads for other in STAGE_TABLE)
        assert task["targets"] == ([f"{WORKSPACE_DIR}/{rid}/{row.output}"] if read_later and not row.in_bundle
                                   else [])
    dodo = runpy.run_path(str(project / "dodo.py"))
    creators = [name[5:] for name in dodo if name.startswith("task_")]
    assert creators == [*STAGES, "generate", "check"]
    assert [dodo[f"task_{row.name}"].__doc__ for row in STAGE_TABLE] == [row.doc for row in STAGE_TABLE]


def test_dodo_lists_no_stage_itself():
    text = (REPO / "dodo.py").read_text()
    assert not any(f"def task_{name}" in text for name in STAGES)


def test_a_table_whose_stage_reads_a_later_one_is_refused():
    rows = (Stage("b", "", facts=(), reads=("a",), output="b.json", runner="m:b", current="record"),
            Stage("a", "", facts=(), reads=(), output="a.json", runner="m:a", current="record"))
    with pytest.raises(ValueError, match="b reads \\['a'\\], not an earlier stage"):
        check_table(rows)
    check_table(rows[::-1])


def test_a_row_without_a_runner_or_with_an_unknown_currentness_rule_is_refused():
    good = dict(doc="", facts=(), reads=(), output="a.json", runner="m:run_a", current="record")
    check_table((Stage("a", **good),))
    for bad in ({"runner": "run_a"}, {"current": "always"}):
        with pytest.raises(ValueError, match="stage table: a: current must be"):
            check_table((Stage("a", **{**good, **bad}),))


# --- the implementation hash -----------------------------------------------------------------


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A stand-in package root with one folder part and one file part."""
    root = tmp_path / "pkg"
    (root / "part" / "sub").mkdir(parents=True)
    (root / "part" / "__init__.py").write_text("")
    (root / "part" / "a.py").write_text("A = 1\n")
    (root / "part" / "sub" / "b.py").write_text("B = 2\n")
    (root / "single.py").write_text("S = 3\n")
    monkeypatch.setattr(hashing, "PACKAGE_ROOT", root)
    return root


EVERY_PART = tuple(sorted({part for row in STAGE_TABLE for part in runner_parts(row.runner, row.dynamic)}))


def _hash(*parts: str) -> str:
    return implementation_sha256.__wrapped__(parts)


def test_the_hash_covers_every_module_of_the_parts(package):
    before = _hash("part", "single.py")
    for path in ("part/sub/b.py", "single.py", "part/__init__.py"):
        original = (package / path).read_text()
        (package / path).write_text(original + "# changed\n")
        assert _hash("part", "single.py") != before, path
        (package / path).write_text(original)
    assert _hash("part", "single.py") == before
    (package / "part" / "c.py").write_text("C = 4\n")  # a new module counts too
    assert _hash("part", "single.py") != before


def test_the_hash_ignores_what_is_not_a_module_of_the_package(package):
    before = _hash("part", "single.py")
    junk = ["part/__pycache__/a.cpython-311.pyc", "part/__pycache__/a.py", "part/a.py~", "part/.#a.py",
            "part/a.orig.py", "part/a (copy).py", "part/.a.py.swp", "part/a.pyc", "part/.hidden/x.py",
            "part/not-a-package/x.py", "notes.py"]
    for rel in junk:
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text("junk\n")
    assert _hash("part", "single.py") == before
    assert [p.relative_to(package).as_posix() for p in part_modules("part")] == [
        "part/__init__.py", "part/a.py", "part/sub/b.py"]


@pytest.mark.parametrize("missing", ["gone.py", "part/gone", "nowhere/x.py"])
def test_a_missing_part_is_an_error_naming_it(package, missing):
    with pytest.raises(ImplementationPartMissing) as err:
        _hash("part", missing)
    assert repr(missing) in str(err.value) and "stage_table.py" in str(err.value), err.value
    assert isinstance(err.value, FileNotFoundError)


def test_the_package_hash_ignores_junk_beside_the_real_modules(tmp_path, monkeypatch):
    """The real parts: a stray backup and a bytecode cache inside a part change nothing."""
    root = tmp_path / "hyper_parallel"
    shutil.copytree(hashing.PACKAGE_ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(hashing, "PACKAGE_ROOT", root)
    before = _hash(*EVERY_PART)
    (root / "codegen" / "plan" / "derive.py~").write_text("stale\n")
    (root / "distributed" / ".#applier.py").write_text("lock\n")
    (root / "models" / "__pycache__").mkdir(exist_ok=True)
    (root / "models" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    assert _hash(*EVERY_PART) == before



def test_a_stage_s_code_is_what_its_runner_imports(tmp_path, monkeypatch):
    """runner_parts follows the runner's imports (its module's top level, the function and
    the helpers it calls, modules named to run with -m) and nothing else of the module."""
    root = tmp_path / "hyper_parallel"
    (root / "pkg").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "used.py").write_text("from hyper_parallel.pkg import deep\n")
    (root / "pkg" / "deep.py").write_text("X = 1\n")
    (root / "pkg" / "worker.py").write_text("W = 1\n")
    (root / "pkg" / "other.py").write_text("O = 1\n")
    (root / "pkg" / "top.py").write_text("T = 1\n")
    (root / "stages.py").write_text(
        "from hyper_parallel.pkg import top\n\n\n"
        "def run_a(spec):\n    from hyper_parallel.pkg.used import thing\n    return helper()\n\n\n"
        "def helper():\n    return ['-m', 'hyper_parallel.pkg.worker']\n\n\n"
        "def run_b(spec):\n    from hyper_parallel.pkg import other\n")
    monkeypatch.setattr(hashing, "PACKAGE_ROOT", root)
    for cached in (hashing.runner_parts, hashing._module_file, hashing._file_imports):
        cached.cache_clear()
    try:
        assert runner_parts("hyper_parallel.stages:run_a") == (
            "pkg/__init__.py", "pkg/deep.py", "pkg/top.py", "pkg/used.py", "pkg/worker.py", "stages.py")
        assert "pkg/other.py" in runner_parts("hyper_parallel.stages:run_b", ("pkg/deep.py",))
        with pytest.raises(ImplementationPartMissing, match="no function 'run_c'"):
            runner_parts("hyper_parallel.stages:run_c")
    finally:
        for cached in (hashing.runner_parts, hashing._module_file, hashing._file_imports):
            cached.cache_clear()
