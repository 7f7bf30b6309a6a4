"""A decoder-only family the planner has never seen (fused qkv and gate/up projections,
whole-projection q/k norms) plans from structure alone and equals one process at tp 2;
a module it cannot classify leaves its part of the layers whole, with a note naming it."""

import json

import pytest
import torch

from hyper_parallel.config.layout import Layout
from hyper_parallel.config.plan_override import parse_plan_overrides
from hyper_parallel.distributed.mesh import ParallelDims
from hyper_parallel.distributed.plan_format import plan_modules_to_json
from hyper_parallel.planning.planner import PlanError, ShardingPlanner
from tests.families.custom_decoder import build_fused_decoder, build_with_unclassifiable
from tests.families.family_cases import FAMILY_CONFIGS, FORMS, UNSEEN_FAMILY, assert_equivalent

CONFIG_DIR = FAMILY_CONFIGS / UNSEEN_FAMILY
DIMS = ParallelDims(tp=2)


def _plan(model, overrides=()):
    """Plan ``model``; ``overrides`` are recipe entries, checked as the loader checks them."""
    return ShardingPlanner(model, Layout(DIMS), overrides=parse_plan_overrides(list(overrides))).plan()


def _meta(builder, config_dir=CONFIG_DIR):
    with torch.device("meta"):
        return builder(config_dir)


def test_unseen_family_is_classified_from_structure():
    result = _plan(_meta(build_fused_decoder))
    plan = plan_modules_to_json(result.modules, result.roles)
    layer = "layers.0"
    assert result.roles[f"{layer}.attn.qkv_proj"] == "fused_qkv"
    assert result.roles[f"{layer}.attn.q_norm"] == "projection_norm"
    assert result.roles[f"{layer}.attn.k_norm"] == "projection_norm"
    assert result.roles[f"{layer}.mlp.gate_up_proj"] == "fused_gate_up"
    assert result.roles[f"{layer}.attn.o_proj"] == "rowwise"
    assert result.roles["embed_tokens"] == "vocab_embedding" and result.roles["lm_head"] == "lm_head"
    # each rank keeps its slice of q, k and v (of gate and up): packed, not a plain shard
    assert plan[f"{layer}.attn.qkv_proj"]["state_shardings"] == {
        "weight": {"tp": "packed_shard(0,3)"}, "bias": {"tp": "packed_shard(0,3)"}}
    assert plan[f"{layer}.mlp.gate_up_proj"]["state_shardings"] == {"weight": {"tp": "packed_shard(0,2)"}}
    # a whole-projection norm gathers the head-sharded projection and hands its slice back
    norm = plan[f"{layer}.attn.q_norm"]
    assert (norm["in_src"], norm["in_dst"]) == ([{"tp": "shard(-1)"}], [{"tp": "replicate"}])
    assert norm["out_dst"] == [{"tp": "shard(-1)"}]


@pytest.mark.parametrize("form", FORMS)
def test_unseen_family_equals_single_process(family_results, form):
    for result in family_results[f"{UNSEEN_FAMILY}-{form}"]:
        assert_equivalent(result, form)
        assert "layers.1.attn.qkv_proj.weight" in result["sharded_params"], result["sharded_params"]
        assert "layers.1.mlp.gate_up_proj.weight" in result["sharded_params"]


def test_unclassifiable_module_leaves_its_layer_part_whole_naming_it():
    # A module nothing classifies inside a decoder layer (a mixing matrix in attention): the
    # attention of every layer is replicated whole (exact at any tp) and the plan's note names
    # the module; the MLP is still split. (Outside the layers such a module is refused.)
    result = _plan(_meta(build_with_unclassifiable))
    assert [note.split(":")[0] for note in result.notes] == ["layers.*.attn replicated whole over tp"], result.notes
    note = result.notes[0]
    assert "layers.*.attn.mixer (MixingProjection; parameters mixer [64, 64])" in note, note
    assert "plan_overrides entry can place it" in note, note
    assert {result.roles[f"layers.1.attn.{name}"] for name in ("qkv_proj", "o_proj", "mixer")} == {"replicate"}
    assert result.roles["layers.1.mlp.gate_up_proj"] == "fused_gate_up"


def test_recipe_override_places_an_unclassifiable_module():
    override = {"match": "layers.*.attn.mixer", "params": {"mixer": {"tp": "replicate"}}}
    result = _plan(_meta(build_with_unclassifiable), [override])
    plan = plan_modules_to_json(result.modules, result.roles)
    assert plan["layers.1.attn.mixer"] == {"role": "override", "state_shardings": {"mixer": {"tp": "replicate"}},
                                           "in_src": None, "in_dst": None, "out_src": None, "out_dst": None,
                                           "local_map": False}, plan["layers.1.attn.mixer"]
    # the rest is derived as without the module
    assert result.roles["layers.1.attn.qkv_proj"] == "fused_qkv"


def test_incomplete_override_of_an_unclassifiable_module_names_what_is_missing():
    model = _meta(build_with_unclassifiable)
    model.layers[1].attn.mixer.scale = torch.nn.Parameter(torch.ones(64, 64))
    override = {"match": "layers.1.attn.mixer", "params": {"mixer": {"tp": "replicate"}}}
    with pytest.raises(PlanError) as err:
        _plan(model, [override])
    message = str(err.value)
    assert "plan_overrides[0]: module 'layers.1.attn.mixer' has no derived plan entry" in message, message
    assert "'params' lacks ['scale']" in message, message


def test_inactive_override_does_not_cover_an_unclassifiable_module():
    override = {"match": "layers.*.attn.mixer", "when": "cp", "params": {"mixer": {"tp": "replicate"}}}
    result = _plan(_meta(build_with_unclassifiable), [override])
    assert any("layers.*.attn.mixer (MixingProjection" in note for note in result.notes), result.notes


def test_fused_qkv_with_unequal_parts_fails_naming_it(tmp_path):
    config = json.loads((CONFIG_DIR / "config.json").read_text())
    config["num_key_value_heads"] = 2  # GQA: [q | k | v] parts of 64, 32, 32 would need a different fused width
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = _meta(build_fused_decoder, tmp_path)
    with pytest.raises(PlanError) as err:
        _plan(model)
    message = str(err.value)
    assert "fused projection layers.0.attn.qkv_proj" in message, message
    assert "num_attention_heads=4, num_key_value_heads=2" in message, message
