"""The IO placement fields (``in_src``, ``in_dst``, ``out_src``, ``out_dst``) have one
definition, next to ``ShardingConfig``; every site walks that tuple."""

import ast
import dataclasses
from pathlib import Path

import hyper_parallel
from hyper_parallel.config.plan_override import PlanOverride
from hyper_parallel.distributed.plan_format import sharding_config_to_json
from hyper_parallel.protocols.sharding import IO_PLACEMENT_FIELDS, ShardingConfig

PACKAGE_DIR = Path(hyper_parallel.__file__).parent


def test_the_fields_are_sharding_configs_own():
    names = tuple(field.name for field in dataclasses.fields(ShardingConfig))
    assert names == ("state_shardings", *IO_PLACEMENT_FIELDS, "local_map", "local_sizes", "local_slices",
                     "state_handoff")


def test_recipes_and_the_plan_format_spell_the_same_fields():
    override_fields = {field.name for field in dataclasses.fields(PlanOverride)}
    assert set(IO_PLACEMENT_FIELDS) <= override_fields
    entry = sharding_config_to_json(ShardingConfig())
    assert tuple(key for key in entry if key in IO_PLACEMENT_FIELDS) == IO_PLACEMENT_FIELDS


def test_no_module_spells_the_fields_again():
    spelled = set(IO_PLACEMENT_FIELDS)
    offenders = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path == PACKAGE_DIR / "protocols" / "sharding.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                texts = {item.value for item in node.elts if isinstance(item, ast.Constant)}
                if spelled <= texts:
                    offenders.append(f"{path.relative_to(PACKAGE_DIR)}:{node.lineno}")
    assert offenders == [], "use hyper_parallel.protocols.sharding.IO_PLACEMENT_FIELDS"
