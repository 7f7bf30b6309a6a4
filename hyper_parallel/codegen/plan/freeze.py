"""Freeze a derived plan: validate, normalize, compress by pattern. Torch-free.

``model.layers.0.self_attn.q_proj`` … ``model.layers.47.self_attn.q_proj`` with equal
entries become one ``model.layers.*.self_attn.q_proj`` entry, so the frozen plan has
as many entries for 94 layers as for 48. A pattern is only used when, matched the way
the applier matches (``name_match`` over every module name of the model), it selects
exactly the modules it replaces, so no two frozen keys hit one module and no precedence
is left to decide; entries that differ between layers (dense vs MoE layers, an
entry for layer 0 only) keep their exact names. Then equal entries whose keys differ
in one character become one key with a character class (``self_attn.[qkv]_proj``),
under the same exactness rule.
"""

import json
import re
from typing import Any

from hyper_parallel.distributed.name_match import names_matching
from hyper_parallel.distributed.plan_format import PLAN_FORMAT_VERSION
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.protocols.sharding_json import PlanFormatError, sharding_config_from_json, sharding_config_to_json

_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")


class FreezeError(ValueError, HyperParallelError):
    """A derived plan that cannot be frozen; names the module and field."""


def freeze_plan(plan: dict[str, Any], module_names: list[str]) -> dict[str, Any]:
    """``module_names``: every module FQN of the planned model (what a pattern could hit)."""
    normalized: dict[str, dict[str, Any]] = {}  # an entry's JSON -> the entry normalized (layers repeat entries)
    modules = {fqn: _normalized_once(fqn, entry, normalized) for fqn, entry in plan["modules"].items()}
    if not modules:
        raise FreezeError("the derived plan has no module entries; nothing would be parallelized")
    return {
        "format": PLAN_FORMAT_VERSION,
        "layout": dict(plan["layout"]),
        "applied_axes": list(plan["applied_axes"]),
        "recorded_axes": dict(sorted(plan["recorded_axes"].items())),
        **({"pipeline": dict(plan["pipeline"])} if "pipeline" in plan else {}),
        "modules": merge_by_character(compress_by_pattern(modules, module_names), module_names),
    }


def compress_by_pattern(modules: dict[str, dict[str, Any]], module_names: list[str]) -> dict[str, dict[str, Any]]:
    """Every index written ``*`` where that keeps the entries equal (``layers.*.experts.*``);
    else only the first index, the layer number (``h.*.ffn.0`` beside ``h.*.ffn.2``, the
    children of a Sequential); else the exact names."""
    out: dict[str, dict[str, Any]] = {}
    for members in _groups(modules, lambda fqn: _LAYER_INDEX.sub(".*", fqn)).values():
        if not _compress_group(modules, members, _LAYER_INDEX.sub(".*", members[0]), module_names, out):
            for layer_members in _groups({m: modules[m] for m in members}, _first_index).values():
                if not _compress_group(modules, layer_members, _first_index(layer_members[0]), module_names, out):
                    out.update((m, modules[m]) for m in layer_members)
    return out


def merge_by_character(modules: dict[str, dict[str, Any]], module_names: list[str]) -> dict[str, dict[str, Any]]:
    """Equal entries under keys that differ only in one character (``q_proj``, ``k_proj``,
    ``v_proj``) as one key with a class (``[qkv]_proj``), where that class selects exactly
    the modules the keys selected; the merged key takes the first member's place."""
    merged: dict[str, str] = {}  # member key -> the key that replaces it
    canonical = {key: _canonical(entry) for key, entry in modules.items()}
    hits = {key: names_matching(key, module_names) for key in modules}
    for index in range(max(map(len, modules), default=0)):
        buckets: dict[tuple, list[str]] = {}
        for key in modules:
            if key not in merged and _plain_char(key, index):
                buckets.setdefault((key[:index], key[index + 1:], canonical[key]), []).append(key)
        for (head, tail, _), members in buckets.items():
            if len(members) < 2:
                continue
            pattern = f"{head}[{''.join(key[index] for key in members)}]{tail}"
            hit = {name for key in members for name in hits[key]}
            if set(names_matching(pattern, module_names)) == hit:
                merged.update((key, pattern) for key in members)
    out: dict[str, dict[str, Any]] = {}
    for key, entry in modules.items():
        out.setdefault(merged.get(key, key), entry)
    return out


def _plain_char(key: str, index: int) -> bool:
    """A character a class may stand for: a letter (not a digit: ``layers.[12]`` would
    read as layer twelve), never part of a glob."""
    return index < len(key) and key[index].isalpha()


def _canonical(entry: dict[str, Any]) -> str:
    return json.dumps(entry, sort_keys=True)


def _groups(modules, key) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for fqn in modules:
        groups.setdefault(key(fqn), []).append(fqn)
    return groups


def _first_index(fqn: str) -> str:
    return _LAYER_INDEX.sub(".*", fqn, count=1)


def _compress_group(modules, members: list[str], pattern: str, module_names: list[str], out: dict) -> bool:
    """One entry for ``members`` under ``pattern`` if they are equal and it selects exactly them."""
    first = modules[members[0]]
    if pattern == members[0] or any(modules[m] != first for m in members[1:]):
        return False
    if not _selects_exactly(pattern, members, module_names):
        return False
    out[pattern] = first
    return True


def _selects_exactly(pattern: str, members: list[str], module_names: list[str]) -> bool:
    return set(names_matching(pattern, module_names)) == set(members)


def _normalized_once(fqn: str, entry: dict[str, Any], normalized: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``_normalize_entry``, once for each distinct entry (every layer repeats its kind's)."""
    key = json.dumps(entry, sort_keys=True)
    if key not in normalized:
        normalized[key] = _normalize_entry(fqn, entry)
    return normalized[key]


def _normalize_entry(fqn: str, entry: dict[str, Any]) -> dict[str, Any]:
    """The entry through the one entry codec, both ways: checked, keys in order, placement
    text normalized (so equal entries are equal dicts, which compression relies on)."""
    try:
        config = sharding_config_from_json(entry, where=fqn)
        return sharding_config_to_json(config, str(entry.get("role", "")), where=fqn)
    except PlanFormatError as exc:
        raise FreezeError(str(exc)) from None
