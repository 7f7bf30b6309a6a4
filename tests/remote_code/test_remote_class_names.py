"""A recipe names remote-code classes as the model folder does — ``auto_map``'s
``modeling_fused.FusedAttention`` — not by the ``transformers_modules.<folder>.<hash>``
module transformers loads them as: in placement overrides (the planner selecting
modules) and in ``replace_module`` entries (derive and the generated model replacing
them)."""

import pytest
import yaml

from hyper_parallel.runtime.loader import load_generated_module
from hyper_parallel.codegen.manager import load_spec, run_pipeline
from hyper_parallel.codegen.plan.derive import build_meta_model
from hyper_parallel.runtime import ReplacementError
from hyper_parallel.codegen.spec.types import STAGES
from hyper_parallel.config.plan_override import parse_plan_overrides
from hyper_parallel.planning.plan_lint import PlanError
from hyper_parallel.planning.plan_overrides import overridden_modules
from tests.remote_code import remote_replacements
from tests.remote_code.remote_project import BUNDLE, MODEL_DATA, RECIPE, make_remote_project
from tests.remote_code.remote_tp_worker import build_remote_model

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

THROUGH_INSTALL = STAGES[:STAGES.index("install") + 1]
REPLACE_ATTENTION = {"match": "*.self_attn", "module_type": "modeling_fused.FusedAttention",
                     "replace_module": {"_target_": "tests.remote_code.remote_replacements.marked_attention"}}


def test_placement_overrides_select_remote_classes_by_the_folder_spelling():
    model, _ = build_remote_model(str(MODEL_DATA))
    assert type(model.model.layers[0].self_attn.q_norm).__module__.startswith("transformers_modules.")
    entry = {"match": "model.layers.*.self_attn.*", "module_type": "modeling_fused.FusedRMSNorm",
             "params": {"weight": {"tp": "replicate"}}}
    assert overridden_modules(parse_plan_overrides([entry]), model) == {f"model.layers.{i}.self_attn.{norm}"
                                                  for i in (0, 1) for norm in ("q_norm", "k_norm")}
    with pytest.raises(PlanError, match=r"none of module_type 'modeling_fused.FusedMLP'.*modeling_fused"):
        overridden_modules(parse_plan_overrides([{**entry, "module_type": "modeling_fused.FusedMLP"}]), model)


def remote_recipe(tmp_path, overrides):
    project = make_remote_project(tmp_path / "project")
    recipe = project / RECIPE
    data = yaml.safe_load(recipe.read_text())
    data["accelerator"].update(tp_size=1, nproc_per_node=1)
    data["plan_overrides"] = overrides
    data["model"]["trusted_modules"] = ["tests.remote_code"]  # the replacement factories here
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    return project, load_spec(recipe, project / "generated")


def test_replace_module_with_a_remote_module_type_is_applied(tmp_path):
    project, spec = remote_recipe(tmp_path, [REPLACE_ATTENTION])
    run_pipeline(spec, THROUGH_INSTALL)
    assert "modeling_fused.FusedAttention" in (project / BUNDLE / "modeling_Hp_Fused_Decoder_gen_cpu.py").read_text()

    remote_replacements.CALLS.clear()
    module = load_generated_module(project / BUNDLE)
    model, _ = build_meta_model(spec, module.FusedDecoderForCausalLM)
    assert remote_replacements.CALLS == ["FusedAttention"] * len(model.model.layers)
    assert all(layer.self_attn.replaced_by_recipe for layer in model.model.layers)


def test_replace_module_with_the_wrong_remote_module_type_names_both(tmp_path):
    _, spec = remote_recipe(tmp_path, [{**REPLACE_ATTENTION, "module_type": "modeling_fused.FusedMLP"}])
    with pytest.raises(ReplacementError, match=r"model\.layers\.0\.self_attn is .*FusedAttention, "
                                               r"expected modeling_fused\.FusedMLP"):
        run_pipeline(spec, THROUGH_INSTALL)
