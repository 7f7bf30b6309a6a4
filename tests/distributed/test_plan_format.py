import json
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.mesh import ParallelDims
from hyper_parallel.distributed.plan_format import (
    PlanFormatError,
    plan_entries,
    plan_from_json,
    plan_modules_from_json,
    plan_modules_to_json,
    plan_to_json,
    sharding_config_from_json,
    sharding_config_to_json,
)
from hyper_parallel.planning.planner import ShardingPlanner
from hyper_parallel.protocols.sharding import ShardingConfig
from hyper_parallel.protocols.sharding_json import compact_entry, entry_line, full_entry

REPO = Path(__file__).resolve().parents[2]


def test_entry_has_every_key_in_fixed_order():
    config = ShardingConfig(state_shardings={"weight": {"tp": Shard(1)}},
                            in_src={"tp": Shard(-1)}, out_src=({"tp": Partial()},), out_dst=({"tp": Replicate()},))
    entry = sharding_config_to_json(config, "rowwise")
    assert list(entry) == ["role", "state_shardings", "in_src", "in_dst", "out_src", "out_dst", "local_map"]
    assert entry["in_src"] == [{"tp": "shard(-1)"}]  # a single named placement is the first input
    assert entry["in_dst"] is None and entry["local_map"] is False
    back = sharding_config_from_json(entry)
    assert back.state_shardings == {"weight": {"tp": "shard(1)"}}
    assert back.out_dst == ({"tp": "replicate"},)


def test_planner_plan_round_trips_and_serialises_deterministically(meta_model):
    dims = ParallelDims(tp=2)
    result = ShardingPlanner(meta_model, Layout(dims)).plan()
    doc = plan_to_json(layout=Layout(dims), applied_axes=result.applied_axes,
                       recorded_axes=result.recorded_axes, modules=result.modules, roles=result.roles)
    text = json.dumps(doc)
    parsed = plan_from_json(json.loads(text))
    assert parsed.layout == Layout(dims) and doc["layout"]["tp"] == 2
    assert parsed.roles["model.layers.0.mlp.experts"] == "packed_experts"
    again = plan_to_json(layout=parsed.layout, applied_axes=parsed.applied_axes,
                         recorded_axes=parsed.recorded_axes, modules=parsed.modules, roles=parsed.roles)
    assert json.dumps(again) == text
    experts = doc["modules"]["model.layers.0.mlp.experts"]
    assert experts["state_shardings"]["gate_up_proj"] == {"tp": "packed_shard(1,2)"}


def test_format_errors_name_the_place():
    with pytest.raises(PlanFormatError, match=r"modules\['lm_head'\]: unknown keys \['colour'\]"):
        plan_modules_from_json({"lm_head": {"colour": 1}})
    with pytest.raises(PlanFormatError, match=r"modules\['x'\]\.state_shardings\.weight.*unknown placement 'rows'"):
        plan_modules_from_json({"x": {"state_shardings": {"weight": {"tp": "rows"}}}})
    with pytest.raises(PlanFormatError, match=r"plan\.format: expected 2, got 3"):
        plan_from_json({"format": 3, "layout": {}, "applied_axes": [], "recorded_axes": {}, "modules": {}})
    with pytest.raises(PlanFormatError, match=r"missing keys \['applied_axes'"):
        plan_from_json({"format": 2, "layout": {}, "modules": {}})
    with pytest.raises(PlanFormatError, match="local_map: expected true or false"):
        sharding_config_from_json({"local_map": "yes"})


def test_plan_modules_to_json_is_torch_free_for_text_configs():
    modules = {"m": ShardingConfig(state_shardings={"weight": {"tp": "Shard(0)"}}, local_map=True)}
    assert plan_modules_to_json(modules) == {"m": {
        "role": "custom", "state_shardings": {"weight": {"tp": "shard(0)"}},
        "in_src": None, "in_dst": None, "out_src": None, "out_dst": None, "local_map": True}}


def test_json_side_imports_no_torch():
    # the freeze stage and up-to-date checks read and write plans without paying for torch
    code = ("import sys; from hyper_parallel.distributed import plan_format, mesh; "
            "from hyper_parallel.protocols import placement_text; "
            "plan_format.plan_modules_to_json(plan_format.plan_modules_from_json("
            "{'m': {'state_shardings': {'w': {'tp': 'shard(0)'}}}})); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def test_the_compact_entry_decodes_to_the_same_config():
    full = sharding_config_to_json(ShardingConfig(
        state_shardings={"weight": {"tp": "shard(0)"}}, in_src=({"tp": "replicate"},), in_dst=({"tp": "replicate"},),
        out_src=({"tp": "partial"}, None), out_dst=({"tp": "replicate"}, None), local_map=True), "rowwise")
    compact = compact_entry(full)
    assert compact == {"role": "rowwise", "state_shardings": {"weight": {"tp": "shard(0)"}},
                       "in_src": {"tp": "replicate"}, "out_src": [{"tp": "partial"}, None],
                       "out_dst": [{"tp": "replicate"}, None], "local_map": True}
    assert sharding_config_from_json(compact) == sharding_config_from_json(full)
    bare = compact_entry(sharding_config_to_json(ShardingConfig(in_src=({"tp": "shard(1)"},)), "custom"))
    assert bare == {"role": "custom", "in_src": {"tp": "shard(1)"}, "in_dst": None}  # an explicit null dst stays
    assert sharding_config_from_json(bare).in_dst is None


LINE_CASES = [
    ShardingConfig(state_shardings={"weight": {"tp": "shard(0)"}}, in_src=({"tp": "replicate"},),
                   in_dst=({"tp": "replicate"},), out_src=({"tp": "partial"}, None),
                   out_dst=({"tp": "replicate"}, None), local_map=True),
    ShardingConfig(in_src=({"tp": "shard(1)"},)),  # an explicit null dst
    ShardingConfig(in_dst=({},)),  # no src, an empty named placement
    ShardingConfig(state_shardings={"gate_up_proj": {"tp": "packed_shard(1,2)", "ep": "shard(0)"}, "down_proj": {}},
                   in_src=({"tp": "replicate", "ep": "shard(0)"},) * 3,
                   out_src=({"cp": "replicate", "tp": "partial"}, None), out_dst=({"cp": "shard(1)", "tp": "shard(1)"}, None)),
    ShardingConfig(out_src=(None,), out_dst=(None, {"tp": "shard(0)"})),
    # a recurrent layer on this rank's heads: a child's parameter, sizes and packed blocks
    ShardingConfig(state_shardings={"A_log": {"tp": "shard(0)"}, "conv1d.weight": {"tp": "replicate"}},
                   local_map=True, local_sizes=("num_v_heads", "key_dim"),
                   local_slices={"conv1d.weight": (0, ("key_dim", "key_dim", "value_dim"))}),
    # a recurrent block on the rank's tokens, its state handed on over cp
    ShardingConfig(in_src=({"cp": "shard(1)"},), in_dst=({"cp": "shard(1)"},), out_src=({"cp": "shard(1)"},),
                   out_dst=({"cp": "shard(1)"},), local_map=True, state_handoff="cp"),
]


@pytest.mark.parametrize("config", LINE_CASES)
def test_the_line_form_decodes_to_the_same_entry(config):
    full = sharding_config_to_json(config, "rowwise")
    line = entry_line(full)
    assert isinstance(line, str) and "\n" not in line
    assert line.startswith("rowwise")
    assert full_entry(line) == full
    assert sharding_config_from_json(line) == sharding_config_from_json(full)


def test_the_line_form_reads_like_the_legend_says():
    full = sharding_config_to_json(LINE_CASES[0], "rowwise")
    assert entry_line(full) == ("rowwise | weight: tp=shard(0) | in: tp=replicate "
                                "| out: (tp=partial, -) -> (tp=replicate, -) | local_map")


def test_a_parameter_named_like_a_field_word_keeps_the_dict_form():
    full = sharding_config_to_json(ShardingConfig(state_shardings={"out": {"tp": "shard(0)"}}), "custom")
    assert entry_line(full) == {"role": "custom", "state_shardings": {"out": {"tp": "shard(0)"}}}
    assert full_entry(entry_line(full)) == full


@pytest.mark.parametrize("line, message", [
    ("", r"should start with a role name"),
    ("colwise | weight tp=shard(0)", r"field 'weight tp=shard\(0\)' is not NAME: VALUE or local_map"),
    ("colwise | weight: tp=shard(0) | weight: tp=replicate", r"field 'weight: tp=replicate' repeats"),
    ("colwise | weight: tp shard(0)", r"state_shardings\.weight: expected AXIS=PLACEMENT pairs"),
    ("colwise | weight: xp=shard(0)", r"unknown mesh axis 'xp'"),
    ("colwise | in: tp=shard(x)", r"in_src.*unknown placement"),
    ("colwise | in: (tp=shard(0), tp=sharded)", r"in_src\[1\].*unknown placement"),
    ("head_split | local_slices: conv1d.weight=x(key_dim)", r"local_slices: expected PARAM=DIM\(ATTR,...\)"),
    ("head_split | local_sizes: 2heads", r"local_sizes: expected a list of attribute names"),
    ("state_handoff | local_map | state_handoff: c p", r"state_handoff: expected a mesh axis name such as cp"),
])
def test_a_malformed_line_names_the_field(line, message):
    with pytest.raises(PlanFormatError, match=message):
        sharding_config_from_json(line, where="modules['m']")


def test_the_state_handoff_field_reads_like_the_legend_says():
    line = entry_line(sharding_config_to_json(LINE_CASES[-1], "state_handoff"))
    assert line == "state_handoff | in: cp=shard(1) | out: cp=shard(1) | local_map | state_handoff: cp"
    assert "state_handoff" not in sharding_config_to_json(LINE_CASES[0], "rowwise")


def test_the_head_split_fields_read_like_the_legend_says():
    line = entry_line(sharding_config_to_json(LINE_CASES[-2], "head_split"))
    assert line == ("head_split | A_log: tp=shard(0) | conv1d.weight: tp=replicate | local_map"
                    " | local_sizes: num_v_heads key_dim | local_slices: conv1d.weight=0(key_dim,key_dim,value_dim)")
    # entries without them keep the keys they always had (plans and bundles do not change)
    assert "local_sizes" not in sharding_config_to_json(LINE_CASES[0], "rowwise")


def test_plan_entries_reads_every_form():
    plan = {"modules": {"a": "colwise | weight: tp=shard(0)", "b": {"role": "rowwise", "local_map": True}}}
    entries = plan_entries(plan)
    assert entries["a"]["state_shardings"] == {"weight": {"tp": "shard(0)"}} and entries["a"]["role"] == "colwise"
    assert entries["b"]["local_map"] is True and entries["b"]["in_src"] is None


def test_an_axis_the_plan_could_not_place_is_a_warning_naming_its_recipe_key():
    from hyper_parallel.distributed.plan_format import unapplied_axis_warnings

    lines = unapplied_axis_warnings({"dp": "the trainer's", "ep": "no experts module of this model ..."})
    assert lines == ["note: ep not applied: no experts module of this model ... (accelerator.ep_size has no effect on "
                     "this model; set it to its default to drop this warning)"]
