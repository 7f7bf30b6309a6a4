"""The frozen plan's size does not grow with the number of layers."""

import json

import pytest
import yaml

from tests.project_fixtures import MAIN_RECIPE, doit

pytestmark = pytest.mark.slow


def _frozen(project, recipe: str) -> dict:
    proc = doit(project, "freeze", f"config={recipe}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    workspace = project / "generated" / recipe[:-5].replace("/", "+")
    return json.loads((workspace / "frozen.json").read_text())["frozen"]


def test_48_and_94_layer_plans_have_the_same_entries(project):
    data = yaml.safe_load((project / MAIN_RECIPE).read_text())
    data["model"]["pretrained_model_name_or_path"] = "../models/Qwen3-30B-A3B"
    data["model"]["config_overrides"] = {"num_hidden_layers": 94}
    deep = project / "recipes/deep/qwen3_moe_94.yaml"
    deep.parent.mkdir()
    deep.write_text(yaml.safe_dump(data, sort_keys=False))

    shallow_plan = _frozen(project, MAIN_RECIPE)
    deep_plan = _frozen(project, "recipes/deep/qwen3_moe_94.yaml")
    assert len(shallow_plan["modules"]) == len(deep_plan["modules"]) > 5
    assert list(shallow_plan["modules"]) == list(deep_plan["modules"])
    assert "model.layers.*.self_attn.[qkv]_proj" in deep_plan["modules"]
    plan = json.loads((project / "generated/recipes+deep+qwen3_moe_94/plan.json").read_text())
    assert sum(k.endswith(".self_attn.q_proj") for k in plan["plan"]["modules"]) == 94
