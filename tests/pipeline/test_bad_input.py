"""Bad recipes fail with a message naming the file/key, expected and actual, and never
touch the bundle already installed in the recipe's folder (issue: bad input).

Each bad recipe is written into recipes/tiny_cpu/, beside the good one, so it would
install into the same recipes/tiny_cpu/generated/ bundle. Cases rejected before the
derive stage run the real CLI as a subprocess; the few that need torch (the planner's
divisibility lints, replace_module, unmatched overrides) run the same ``main()`` in
this process so torch is imported once.
"""

from pathlib import Path

import pytest

from hyper_parallel.codegen import cli as codegen_cli
from tests.pipeline.pipeline_helpers import BUNDLE, ENV, copy_project, generated_tiny_project
from tests.project_fixtures import TINY_RECIPE, bundle_bytes, cli

TINY_DIR = Path(TINY_RECIPE).parent
MODEL = "  pretrained_model_name_or_path: models/tiny-qwen3-moe\n"


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A copy of the generated tiny project (bundle installed) and its bundle bytes."""
    source = generated_tiny_project(tmp_path_factory)
    project = copy_project(source, tmp_path_factory.mktemp("bad_input") / "project")
    return project, bundle_bytes(project / BUNDLE)


def _write_recipe(project: Path, name: str, text: str) -> str:
    rel = (TINY_DIR / name).as_posix()
    (project / rel).write_text(text)
    return rel


def _assert_bundle_untouched(project: Path, before: dict[str, bytes]) -> None:
    assert bundle_bytes(project / BUNDLE) == before
    leftovers = [p.name for p in (project / TINY_DIR).iterdir() if p.name.startswith(".hp-bundle-")]
    assert leftovers == []


# --- rejected before any torch import: the CLI as a subprocess -------------------------------

def _nested(key: str) -> str:
    return f"model:\n{MODEL}accelerator:\n  {key}: 2\n  nproc_per_node: 2\n"


SUBPROCESS_CASES = {
    "malformed_yaml": (
        f"model:\n{MODEL}accelerator: [tp_size: 2\n", {},
        ["malformed_yaml.yaml", "malformed YAML", "line 3"]),
    "unknown_top_level_key": (
        f"model:\n{MODEL}acceleratr:\n  tp_size: 2\n", {},
        ["unknown_top_level_key.yaml", "unknown key 'acceleratr'", "expected one of", "accelerator"]),
    "unknown_nested_key": (
        _nested("tpsize"), {},
        ["unknown_nested_key.yaml", "unknown key 'accelerator.tpsize'", "tp_size"]),
    "missing_config_json": (
        "model:\n  pretrained_model_name_or_path: models/empty\n", {},
        ["missing_config_json.yaml", "model.pretrained_model_name_or_path", "no config.json",
         "models/empty"]),
    "unknown_model_type": (
        "model:\n  pretrained_model_name_or_path: models/no-such-model\n", {},
        ["unknown_model_type.yaml", "unknown model_type 'no_such_model'"]),
    "world_size_mismatch": (
        _nested("tp_size"), {"WORLD_SIZE": "3", "RANK": "0"},
        ["world_size_mismatch.yaml", "world size dp*cp*tp*pp = 2", "WORLD_SIZE=3"]),
}


@pytest.mark.parametrize("case", sorted(SUBPROCESS_CASES))
def test_rejected_recipe_names_the_problem_and_keeps_the_bundle(project, case):
    project, before = project
    text, env, expected = SUBPROCESS_CASES[case]
    (project / TINY_DIR / "models" / "empty").mkdir(exist_ok=True)
    no_such = project / TINY_DIR / "models" / "no-such-model"
    no_such.mkdir(exist_ok=True)
    (no_such / "config.json").write_text('{"model_type": "no_such_model"}\n')
    recipe = _write_recipe(project, f"{case}.yaml", text)

    proc = cli(project, "generate", "--config", recipe, "--skip-preflight", env={**ENV, **env})

    assert proc.returncode != 0, proc.stdout
    for fragment in expected:
        assert fragment in proc.stderr, f"{fragment!r} not in:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    _assert_bundle_untouched(project, before)


# --- rejected by the derive stage: main() in this process (torch imported once) ----------------

def _tp4(extra_model: str = "") -> str:
    return f"model:\n{MODEL}{extra_model}accelerator:\n  tp_size: 4\n  nproc_per_node: 4\n"


def _tp2_override(entry: str) -> str:
    return f"model:\n{MODEL}accelerator:\n  tp_size: 2\n  nproc_per_node: 2\nplan_overrides:\n{entry}"


DERIVE_CASES = {
    "tp_not_dividing_kv_heads": (
        _tp4(), ["tp_not_dividing_kv_heads.yaml", "tp_size=4", "num_key_value_heads=2"]),
    "tp_not_dividing_heads": (
        _tp4("  config_overrides:\n    num_attention_heads: 6\n"),
        ["tp_not_dividing_heads.yaml", "tp_size=4", "num_attention_heads=6"]),
    "ep_not_dividing_experts": (
        f"model:\n{MODEL}accelerator:\n  dp_size: 3\n  ep_size: 3\n  nproc_per_node: 3\n",
        ["ep_not_dividing_experts.yaml", "ep_size=3", "num_experts=4"]),
    "replace_module_target_not_importable": (
        _tp2_override("  - match: model.layers.*.self_attn\n"
                      "    replace_module:\n      _target_: no_such_package.make_attention\n"),
        ["replace_module_target_not_importable.yaml", "no_such_package.make_attention",
         "cannot import", "No module named 'no_such_package'"]),
    "override_matching_nothing": (
        _tp2_override("  - match: model.no_such_module.*\n    params:\n      weight: {tp: replicate}\n"),
        ["override_matching_nothing.yaml", "plan_overrides[0]", "model.no_such_module.*",
         "hits no module"]),
}


@pytest.mark.parametrize("case", sorted(DERIVE_CASES))
def test_unplannable_recipe_names_the_problem_and_keeps_the_bundle(project, case, monkeypatch, capsys):
    project, before = project
    text, expected = DERIVE_CASES[case]
    recipe = _write_recipe(project, f"{case}.yaml", text)
    monkeypatch.chdir(project)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)

    rc = codegen_cli.main(["generate", "--config", recipe, "--skip-preflight"])

    err = capsys.readouterr().err
    assert rc != 0
    for fragment in expected:
        assert fragment in err, f"{fragment!r} not in:\n{err}"
    _assert_bundle_untouched(project, before)


# --- an artifact directory that cannot be created ---------------------------------------------

@pytest.mark.parametrize("artifact_dir, expected", [
    ("blocker/generated", "blocker exists and is not a directory"),
    ("blocker", "cannot install the bundle at"),
])
def test_uncreatable_artifact_dir_is_a_clear_error(tmp_path_factory, tmp_path, artifact_dir, expected):
    # Tests run as root, which ignores permission bits: a regular file where the bundle
    # directory (or its parent) must go makes the path un-creatable instead.
    project = copy_project(generated_tiny_project(tmp_path_factory), tmp_path / "project")
    before = bundle_bytes(project / BUNDLE)
    (project / TINY_DIR / "blocker").write_text("a file, not a folder\n")
    recipe = project / TINY_RECIPE
    recipe.write_text(recipe.read_text().replace(
        "  attn_implementation: eager\n",
        f"  attn_implementation: eager\n  codegen_artifact_dir: {artifact_dir}\n"))

    proc = cli(project, "generate", "--config", TINY_RECIPE, "--skip-preflight", env=ENV)

    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    assert expected in proc.stderr and "codegen_artifact_dir" in proc.stderr, proc.stderr
    assert (project / TINY_DIR / "blocker").read_text() == "a file, not a folder\n"
    _assert_bundle_untouched(project, before)
