"""One matcher, one precedence rule: every site that resolves module names against plan
keys or globs names the entry the applier applies (``distributed.name_match``).

The cross-site tests use plans where two keys hit one module; if a site kept its own
loop with another rule (first match instead of last, glob before exact), they fail."""

import ast
from pathlib import Path

import pytest
from torch import nn

import hyper_parallel
from hyper_parallel.codegen.plan.freeze import compress_by_pattern
from hyper_parallel.config.plan_override import parse_plan_overrides
from hyper_parallel.distributed.applier import PlanApplyError, _resolve_targets, _states_by_module
from hyper_parallel.distributed.mesh import ParallelDims
from hyper_parallel.distributed.name_match import (
    PlanEntryConflict,
    in_precedence_order,
    is_glob,
    match_plan_keys,
    name_matches,
    names_matching,
    placed_parameters,
    placement_of,
    plan_entry_for,
)
from hyper_parallel.planning.module_roles import _lookup
from hyper_parallel.planning.offline_mesh import build_offline_mesh
from hyper_parallel.planning.plan_lint import PlanError, expand_plan_keys, lint_plan
from hyper_parallel.planning.plan_overrides import merge_plan_overrides
from hyper_parallel.runtime import hyper_apply_replacements
from hyper_parallel.runtime.integrity import uncovered_parameters

PACKAGE_DIR = Path(hyper_parallel.__file__).parent
NAMES = ["", "layers", "layers.0", "layers.0.attn", "layers.0.mlp", "layers.1", "layers.1.attn", "layers.1.mlp",
         "head"]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Linear(4, 4)


class _Tiny(nn.Module):
    """Module names are ``NAMES``."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(4, 4)


def _entry(*params: str, axis: str = "tp", placement: str = "replicate") -> dict:
    return {"state_shardings": {name: {axis: placement} for name in params}}


# --- the rule -------------------------------------------------------------------------------------


def test_glob_characters_make_a_key_a_pattern():
    assert is_glob("layers.*.mlp") and is_glob("layers.?.mlp") and is_glob("layers.[01].mlp")
    assert not is_glob("layers.0.mlp")


def test_star_crosses_dots_and_matching_is_case_sensitive():
    assert names_matching("*.mlp", NAMES) == ["layers.0.mlp", "layers.1.mlp"]
    assert names_matching("layers.*", NAMES) == ["layers.0", "layers.0.attn", "layers.0.mlp", "layers.1",
                                                 "layers.1.attn", "layers.1.mlp"]
    assert names_matching("*.MLP", NAMES) == []
    assert name_matches("layers.0.mlp", "layers.0.mlp") and not name_matches("layers.0.mlp", "layers.0")


def test_a_key_naming_a_module_names_only_that_module():
    names = ["experts", "experts[0]", "experts0"]
    assert names_matching("experts[0]", names) == ["experts[0]"]  # exact, though it holds a glob character
    assert match_plan_keys(names, ["experts[0]"]).applied == {"experts[0]": "experts[0]"}


def test_exact_key_beats_every_glob_wherever_it_stands():
    keys = ["layers.0.mlp", "layers.*.mlp", "*.mlp"]
    matches = match_plan_keys(NAMES, keys)
    assert matches.applied["layers.0.mlp"] == "layers.0.mlp"
    assert plan_entry_for("layers.0.mlp", dict.fromkeys(keys))[0] == "layers.0.mlp"


def test_among_globs_the_last_one_wins():
    keys = ["layers.*.mlp", "*.mlp"]
    assert match_plan_keys(NAMES, keys).applied == {"layers.0.mlp": "*.mlp", "layers.1.mlp": "*.mlp"}
    assert plan_entry_for("layers.1.mlp", dict.fromkeys(keys))[0] == "*.mlp"
    assert plan_entry_for("layers.1.mlp", dict.fromkeys(reversed(keys)))[0] == "layers.*.mlp"


def test_unmatched_and_overlapping_keys_are_reported():
    matches = match_plan_keys(NAMES, ["head", "blocks.*", "layers.*.mlp", "*.mlp"])
    assert [key for key, names in matches.hits.items() if not names] == ["blocks.*"]
    assert matches.hits["layers.*.mlp"] == matches.hits["*.mlp"] == ["layers.0.mlp", "layers.1.mlp"]
    assert plan_entry_for("layers.0.attn", {"head": 1}) is None


def test_precedence_order_applies_what_wins_last():
    keys = ["layers.0.mlp", "*.mlp", "layers.*.mlp", "head"]
    assert [keys[i] for i in in_precedence_order(keys, NAMES)] == ["*.mlp", "layers.*.mlp", "layers.0.mlp", "head"]


# --- every site names the applied entry -----------------------------------------------------------


OVERLAPPING_PLAN = {
    "layers.*": _entry("weight", "bias"),  # also hits the blocks (no direct parameters; unused here)
    "*.mlp": _entry("weight", "bias"),
    "layers.*.mlp": _entry("weight"),  # the last glob for the mlps: it is applied, and it lacks bias
    "layers.0.attn": _entry("weight", "bias", placement="shard(0)"),  # exact: beats "layers.*"
    "head": _entry("weight", "bias"),
}


def test_applier_and_lookup_name_the_same_entry():
    model = _Tiny()
    targets = _resolve_targets(model, OVERLAPPING_PLAN)
    matches = match_plan_keys([name for name, _ in model.named_modules()], OVERLAPPING_PLAN)
    for name, config in targets.items():
        key, _ = plan_entry_for(name, OVERLAPPING_PLAN)
        assert matches.applied[name] == key
        assert set(config.state_shardings) == set(OVERLAPPING_PLAN[key]["state_shardings"]), name
    assert targets["layers.0.attn"].state_shardings["weight"] == {"tp": "shard(0)"}
    assert set(targets["layers.1.mlp"].state_shardings) == {"weight"}


def test_preflight_coverage_judges_the_applied_entry():
    # "*.mlp" covers the mlps' bias, but "layers.*.mlp" (later) is the entry applied, and it
    # does not: a coverage check that took the first match would approve this plan.
    missing = uncovered_parameters(_Tiny(), OVERLAPPING_PLAN)
    assert missing == ["layers.0.mlp.bias", "layers.1.mlp.bias"]
    fixed = {**OVERLAPPING_PLAN, "layers.*.mlp": _entry("weight", "bias")}
    assert uncovered_parameters(_Tiny(), fixed) == []


def test_lint_refuses_overlaps_instead_of_choosing_otherwise():
    with pytest.raises(PlanError, match=r"module 'layers\.0\.mlp' is covered by two plan entries: "
                                        r"'\*\.mlp' and 'layers\.\*\.mlp'"):
        expand_plan_keys(_Tiny(), {"*.mlp": {}, "layers.*.mlp": {}})
    plan = {"layers.*.attn": {}, "layers.1.mlp": {}, "layers.0.mlp": {}, "head": {}}
    model = _Tiny()
    assert expand_plan_keys(model, plan) == match_plan_keys([n for n, _ in model.named_modules()], plan).applied


def test_plan_overrides_follow_the_applier_precedence():
    model = _Tiny()
    derived = {name: _as_config(_entry("weight", "bias")) for name in ("layers.0.mlp", "layers.1.mlp")}
    overrides = [
        {"match": "layers.0.mlp", "params": {"weight": {"tp": "shard(0)"}}},  # exact, first in the list
        {"match": "layers.*.mlp", "params": {"weight": {"tp": "shard(1)"}}},
        {"match": "*.mlp", "params": {"weight": {"tp": "replicate"}}},  # the last glob
    ]
    merged = merge_plan_overrides(derived, parse_plan_overrides(overrides), model)
    as_plan = {entry["match"]: entry["params"]["weight"]["tp"] for entry in overrides}
    for name in ("layers.0.mlp", "layers.1.mlp"):
        applied_key, _ = plan_entry_for(name, as_plan)
        assert _placement_text(merged[name].state_shardings["weight"]["tp"]) == as_plan[applied_key], name
    assert _placement_text(merged["layers.0.mlp"].state_shardings["weight"]["tp"]) == "shard(0)"
    assert _placement_text(merged["layers.1.mlp"].state_shardings["weight"]["tp"]) == "replicate"


def test_planner_hints_follow_the_applier_precedence():
    hints = {"layers.*.mlp": "colwise", "*.mlp": "rowwise", "layers.0.mlp": "replicate"}
    for name in ("layers.0.mlp", "layers.1.mlp"):
        assert _lookup(hints, name) == hints[plan_entry_for(name, hints)[0]]
    assert _lookup(hints, "layers.1.mlp") == "rowwise"
    assert _lookup(hints, "head") is None


def test_frozen_patterns_select_exactly_what_the_applier_gives_them():
    names = [name for name, _ in _Tiny().named_modules()]
    entry = _entry("weight")
    modules = {"layers.0.attn": entry, "layers.1.attn": entry, "layers.0.mlp": entry, "layers.1.mlp": _entry("bias")}
    frozen = compress_by_pattern(modules, names)
    applied = match_plan_keys(names, frozen).applied
    hit = [name for names in match_plan_keys(names, frozen).hits.values() for name in names]
    assert len(hit) == len(set(hit))  # no module is hit by two keys
    assert {name: frozen[key] for name, key in applied.items()} == modules


def test_replacements_hit_what_a_plan_key_hits():
    model = _Tiny()
    hits = hyper_apply_replacements(model, [{"match": "*.mlp", "target": "torch.nn.Identity"}])
    assert hits == len(names_matching("*.mlp", NAMES))
    assert all(isinstance(model.get_submodule(name), nn.Identity) for name in names_matching("*.mlp", NAMES))


def test_no_other_module_matches_names_on_its_own():
    """fnmatch (and with it a second precedence rule) lives in name_match only."""
    offenders = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path.name == "name_match.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            imported = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                        else [node.module] if isinstance(node, ast.ImportFrom) else [])
            if any(name and name.split(".")[0] == "fnmatch" for name in imported):
                offenders.append(f"{path.relative_to(PACKAGE_DIR)}:{node.lineno}")
    assert offenders == [], "match module names with hyper_parallel.distributed.name_match"


def test_name_match_is_a_torch_free_leaf():
    tree = ast.parse((PACKAGE_DIR / "distributed" / "name_match.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    from_modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {module.split(".")[0] for module in from_modules if module != "hyper_parallel.errors"}
    assert imported <= {"fnmatch", "collections", "dataclasses", "typing"}  # errors is itself a leaf


def _as_config(entry: dict):
    from hyper_parallel.distributed.plan_format import sharding_config_from_json

    return sharding_config_from_json(entry)


def _placement_text(placement) -> str:
    from hyper_parallel.protocols.placements import placement_to_text

    return placement if isinstance(placement, str) else placement_to_text(placement)


# --- which entry places a parameter (issue 51) ----------------------------------------------------


CHILD_PLAN = {  # the blocks' entry places their attn's weight by its dotted name, as a head-split entry does
    "layers.?": _entry("attn.weight", placement="shard(0)"),  # the blocks only ("*" would cross dots)
    "layers.*.attn": _entry("bias"),
    "layers.*.mlp": _entry("weight", "bias"),
    "head": _entry("weight", "bias"),
}


def test_an_entry_places_a_childs_parameter_by_its_dotted_name():
    placed = placed_parameters(NAMES, CHILD_PLAN)
    child = placed["layers.1.attn.weight"]
    assert (child.key, child.module, child.state, child.placement) == (
        "layers.?", "layers.1", "attn.weight", {"tp": "shard(0)"})
    assert placed["layers.1.attn.bias"].key == "layers.*.attn"
    assert placement_of("layers.1.attn.weight", CHILD_PLAN) == child  # without the model: the same answer
    assert placement_of("layers.1.attn.nothing", CHILD_PLAN) is None


def test_every_reader_covers_a_childs_parameter_and_applies_it():
    model = _Tiny()
    assert uncovered_parameters(model, CHILD_PLAN) == []  # read at the last dot, the attn weights were uncovered
    lint_plan(model, _as_configs(CHILD_PLAN), build_offline_mesh(ParallelDims()))
    states = _states_by_module(_resolve_targets(model, CHILD_PLAN))  # what the applier shards, per module
    assert [(where.state, where.placement) for where in states["layers.1"]] == [("attn.weight", {"tp": "shard(0)"})]


def test_a_parameter_two_entries_place_is_refused_by_every_reader():
    both = {**CHILD_PLAN, "layers.*.attn": _entry("weight", "bias")}  # attn.weight twice
    message = r"parameter layers\.0\.attn\.weight is placed by two plan entries: 'layers\.\?' \(as 'attn\.weight'\)"
    with pytest.raises(PlanEntryConflict, match=message):
        placed_parameters(NAMES, both)
    with pytest.raises(PlanEntryConflict, match=message):
        uncovered_parameters(_Tiny(), both)
    with pytest.raises(PlanError, match=message):
        lint_plan(_Tiny(), _as_configs(both), build_offline_mesh(ParallelDims()))
    with pytest.raises(PlanApplyError, match=r"layers\.0\.attn\.weight is placed by two plan entries: 'layers\.0' "
                                             r"\(as 'attn\.weight'\) and 'layers\.0\.attn' \(as 'weight'\)"):
        _states_by_module(_resolve_targets(_Tiny(), both))


def _as_configs(plan: dict) -> dict:
    return {key: _as_config(entry) for key, entry in plan.items()}
