"""plan_overrides are parsed and checked once, when the recipe loads (issue 13): the
loader hands frozen PlanOverride objects on, and spec projection, derive, the planner
and the emitter take those objects without checking them again."""

import dataclasses
import shutil
from pathlib import Path

import pytest
import yaml

import hyper_parallel
from hyper_parallel.codegen.emit.modeling import emit_modeling_source
from hyper_parallel.codegen.spec.project import bundle_signature_inputs, project_codegen_spec
from hyper_parallel.config import RecipeError, load_training_config
from hyper_parallel.config import plan_override
from hyper_parallel.config.plan_override import PlanOverride, PlanOverrideError, ReplaceModule, parse_plan_overrides
from tests.project_fixtures import REPO, TINY_RECIPE

PACKAGE_DIR = Path(hyper_parallel.__file__).parent
ATTENTION = "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention"
FUSED = "hyper_parallel.models.qwen3_moe.adapter.replacements.replace_qwen3_moe_flash_attention"
OVERRIDES = [
    {"match": "*.self_attn", "module_type": ATTENTION, "replace_module": {"_target_": FUSED, "b": 2, "a": 1}},
    {"match": "model.norm", "params": {"weight": {"tp": " Replicate "}}},
    {"match": "lm_head", "when": "cp", "out_dst": {"tp": "Shard(-1)"}, "in_src": [None, {"tp": "replicate"}]},
]


def _recipe(tmp_path: Path, overrides: list, **model) -> Path:
    folder = tmp_path / "recipes"
    shutil.copytree(REPO / "recipes/tiny_cpu/models", folder / "models")
    data = yaml.safe_load((REPO / TINY_RECIPE).read_text())
    data["plan_overrides"] = overrides
    data["model"].update(model)
    recipe = folder / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    return recipe


def test_the_loader_hands_on_frozen_typed_entries(tmp_path):
    config = load_training_config(_recipe(tmp_path, OVERRIDES))
    first, second, third = config.plan_overrides
    assert all(isinstance(entry, PlanOverride) for entry in config.plan_overrides)
    assert first.replace_module == ReplaceModule(FUSED, (("a", 1), ("b", 2)))
    assert (first.where, first.places, second.places) == ("plan_overrides[0]", False, True)
    assert second.params[0][0] == "weight" and second.params[0][1][0][1].text() == "replicate"
    assert third.as_json()["in_src"] == [None, {"tp": "replicate"}]
    assert third.as_json()["out_dst"] == [{"tp": "shard(-1)"}]
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.match = "*"


@pytest.mark.parametrize("entry, key, expected", [
    ({"match": "lm_head", "replace_module": {"_target_": "os.system"}},
     "plan_overrides[2].replace_module._target_", "'os.system' is outside the trusted modules (hyper_parallel); "
                                                  "if you trust its package, list it under model.trusted_modules"),
    ({"match": "lm_head", "params": {"weight": {"tp": "halves"}}},
     "plan_overrides[2].params.weight.tp",
     "unknown placement 'halves'; expected replicate | partial | shard(N) | packed_shard(N,K)"),
    ({"match": "lm_head", "in_dst": [{"qp": "replicate"}]},
     "plan_overrides[2].in_dst[0]", "unknown mesh axis 'qp'; expected one of pp, dp, cp, tp, ep"),
    ({"match": "lm_head", "when": "dp"}, "plan_overrides[2].when", "expected one of tp, cp, ep, sp, got 'dp'"),
    ({"match": "", "local_map": True}, "plan_overrides[2].match", "expected str (a module FQN or glob), got ''"),
    ({"match": "lm_head", "exact_type": "yes"}, "plan_overrides[2].exact_type", "expected bool, got str 'yes'"),
    ("lm_head", "plan_overrides[2]", "expected a mapping, got str 'lm_head'"),
])
def test_a_bad_entry_is_refused_at_load_naming_file_key_and_expectation(tmp_path, entry, key, expected):
    recipe = _recipe(tmp_path, [*OVERRIDES[:2], entry])
    with pytest.raises(RecipeError) as err:
        load_training_config(recipe)
    assert str(err.value) == f"{recipe}: {key}: {expected}"


def test_a_bad_trusted_module_is_named_before_the_targets_it_would_allow(tmp_path):
    recipe = _recipe(tmp_path, OVERRIDES, trusted_modules=["ok.pkg", "not dotted"])
    with pytest.raises(RecipeError, match=r"model\.trusted_modules\[1\]: expected a dotted package or module name"):
        load_training_config(recipe)


def test_spec_derive_and_emit_take_the_loaded_objects_and_never_parse_again(tmp_path, monkeypatch):
    config = load_training_config(_recipe(tmp_path, OVERRIDES))
    before = bundle_signature_inputs(project_codegen_spec(config, workspace_root=tmp_path / "ws"))

    def refuse(*args, **kwargs):
        raise AssertionError("an override was parsed again after the recipe loaded")

    monkeypatch.setattr(plan_override, "parse_plan_override", refuse)
    monkeypatch.setattr(plan_override, "parse_plan_overrides", refuse)
    spec = project_codegen_spec(config, workspace_root=tmp_path / "ws")
    assert all(a is b for a, b in zip(spec.plan_overrides, config.plan_overrides, strict=True))
    assert bundle_signature_inputs(spec) == before  # deterministic
    assert spec.replacements == [{"match": "*.self_attn", "module_type": ATTENTION, "exact_type": False,
                                  "target": FUSED, "kwargs": {"a": 1, "b": 2},
                                  "origin": "plan_overrides[0].replace_module._target_"}]
    text = emit_modeling_source(source_text="class M:\n    def __init__(self):\n        self.post_init()\n",
                                source_module="pkg.mod", banner=_banner(), frozen_plan=_plan(),
                                overrides=spec.plan_overrides)
    assert '"kwargs": {"a": 1, "b": 2},' in text and '"origin"' not in text  # shown, minus bookkeeping


def test_override_validation_has_one_definition():
    """The checks an entry gets (its trust check, its error type, placement parsing of a
    recipe entry) are written in config/plan_override.py only."""
    home = PACKAGE_DIR / "config" / "plan_override.py"
    for needle in ("is outside the trusted modules", "raise PlanOverrideError", "class PlanOverride"):
        holders = [path.relative_to(PACKAGE_DIR) for path in sorted(PACKAGE_DIR.rglob("*.py"))
                   if needle in path.read_text(encoding="utf-8")]
        assert holders == [home.relative_to(PACKAGE_DIR)], (needle, holders)
    with pytest.raises(PlanOverrideError, match=r"^plan_overrides: expected a list, got dict"):
        parse_plan_overrides({"match": "x"})


def _banner() -> dict:
    return {"recipe": "r.yaml", "signature": "s", "source_sha256": "h", "transformers_version": "5",
            "parallel_dims": {"tp": 1}}


def _plan() -> dict:
    return {"format": 2, "layout": {"dp": 1, "cp": 1, "tp": 1, "ep": 1, "pp": 1, "sequence_parallel": False, "loss_parallel": False}, "applied_axes": [], "recorded_axes": {},
            "modules": {}}
