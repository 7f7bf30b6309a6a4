"""What generated modeling files call at run time.

- ``hyper_apply_replacements(root, replacements)``: the recipe's ``replace_module``
  entries, applied in the model's ``__init__`` before ``post_init()``.
- ``hyper_parallelize(model, mesh_context, plan)``: hand the frozen plan to the one
  applier (``hyper_parallel.distributed.applier``).

Generated files import this module at import time, so it imports nothing beyond the
standard library, torch and the package's torch-free leaf modules (``class_paths``,
``errors``, and ``name_match``, so a ``replace_module`` glob hits what a plan key
would); the applier is imported when it is first needed.
"""

import importlib
import inspect
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch import nn

from hyper_parallel.class_paths import class_paths
from hyper_parallel.distributed.name_match import name_matches
from hyper_parallel.errors import HyperParallelError

# Set on every module a replacement produced: the keys of the entries applied to it.
# A later call (the head model's __init__ after the base model's) skips those modules.
REPLACED_MARK = "_hyper_replaced_by"
# Set on the root of each call: {fqn relative to the root: target} of what it replaced.
REPLACED_RECORD = "_hyper_replaced"


class ReplacementError(ValueError, HyperParallelError):
    """A replace_module entry that cannot be applied; names the entry and the module."""


def hyper_apply_replacements(root: nn.Module, replacements: Sequence[Mapping[str, Any]]) -> int:
    """Replace every module of ``root`` that an entry's ``match`` glob hits with
    ``target(module, **kwargs)``; return how many modules this call replaced.

    FQNs are those of the top model the planner sees (``model.layers.0.self_attn`` for
    ``Qwen3MoeForCausalLM``). An HF *base* model (``Qwen3MoeModel``, which lacks its
    ``base_model_prefix`` attribute) sits under that prefix in the head, so its modules
    are matched both as ``model.layers.0.self_attn`` and as ``layers.0.self_attn``.
    Modules an entry already replaced are skipped but still count as hits, so the
    head's call after the base model's replaces nothing twice. An entry that hits
    nothing is an error, except in a base model for a pattern that may name a module
    outside it (``lm_head``, ``*.self_attn``): the enclosing model's call checks it.
    """
    prefix = _base_model_prefix(root)
    record = root.__dict__.setdefault(REPLACED_RECORD, {})
    replaced = 0
    for index, entry in enumerate(replacements):
        origin = _origin(entry, index)
        factory = _import_target(entry["target"], origin)
        key = _entry_key(entry)
        hits = 0
        for fqn, name, module in list(_matches(root, entry["match"], prefix)):
            hits += 1
            if key in getattr(module, REPLACED_MARK, ()):
                continue
            _check_module_type(module, name, entry, origin)
            new = factory(module, **dict(entry.get("kwargs") or {}))
            if not isinstance(new, nn.Module):
                raise ReplacementError(f"{origin}: {entry['target']} returned {type(new).__name__} for "
                                       f"{name}, expected an nn.Module")
            setattr(new, REPLACED_MARK, (*getattr(module, REPLACED_MARK, ()), key))
            root.set_submodule(fqn, new)
            record[fqn] = entry["target"]
            replaced += 1
        if hits == 0 and _must_hit_here(entry["match"], prefix):
            raise ReplacementError(
                f"{origin}: match {entry['match']!r} hits no module of {type(root).__name__} "
                f"(an entry that matches nothing is an error, not a no-op); "
                f"module names look like {_sample_names(root, prefix)}")
    return replaced


def hyper_parallelize(model: nn.Module, mesh_context: Any, plan: Mapping[str, Any]) -> nn.Module:
    """Shard ``model`` in place on ``mesh_context`` with a frozen plan; return it. A run of
    another layout than the plan was made for is refused before anything is sharded."""
    from hyper_parallel.distributed.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan_format import plan_from_json

    document = plan_from_json(plan, where="HYPER_PARALLEL_PLAN")
    check_plan_layout(document.layout, mesh_context)
    apply_sharding_plan(model, document.modules, mesh_context, context_parallel=document.context_parallel,
                        roles=document.roles)
    return model


class PlanMeshError(ValueError, HyperParallelError):
    """The plan was made for another layout than the one it is applied on."""


def check_plan_layout(planned: Any, mesh_context: Any) -> None:
    """The mesh context's layout must be the plan's, every field (each size, ep included,
    sp, loss parallel, the context-parallel setting), and so must the sizes of its device
    and expert meshes: a plan applied on another layout shards tensors by the wrong factor
    or places activations another way, and the first sign of it would be a wrong loss,
    not an error."""
    from hyper_parallel.distributed.mesh import expert_mesh_layout, mesh_layout

    given = mesh_context.layout
    differing = planned.differences(given)
    if differing:
        _refuse(planned.describe(), "the run's layout (the mesh context's)", given.describe(), differing)
    for what, mesh, (names, sizes) in (("device mesh", getattr(mesh_context, "device_mesh", None),
                                        mesh_layout(planned.dims)),
                                       ("expert mesh", getattr(mesh_context, "expert_mesh", None),
                                        expert_mesh_layout(planned.dims))):
        if mesh is None or not mesh.mesh_dim_names:
            continue
        expected, actual = dict(zip(names, sizes)), dict(zip(mesh.mesh_dim_names, mesh.shape))
        differing = [axis for axis in {**expected, **actual} if expected.get(axis) != actual.get(axis)]
        if differing:
            _refuse(_mesh_text(expected), f"the {what}", _mesh_text(actual), differing)


def _refuse(planned: str, what: str, given: str, differing: Sequence[str]) -> None:
    raise PlanMeshError(f"HYPER_PARALLEL_PLAN was made for {planned}, but {what} is {given}: "
                        f"{', '.join(differing)} {'differs' if len(differing) == 1 else 'differ'}; regenerate the "
                        f"bundle for this layout (doit generate config=<the recipe>) or build the mesh context from "
                        f"the recipe (MeshContext(device_mesh, config.accelerator.layout))")


def _mesh_text(mesh: Mapping[str, int]) -> str:
    return " ".join(f"{axis}={size}" for axis, size in mesh.items())


def _base_model_prefix(root: nn.Module) -> str:
    """``"model"`` when ``root`` is an HF base model that heads nest under that name."""
    prefix = getattr(type(root), "base_model_prefix", "")
    if isinstance(prefix, str) and prefix and prefix not in root._modules:
        return prefix
    return ""


def _matches(root: nn.Module, pattern: str, prefix: str) -> Iterator[tuple[str, str, nn.Module]]:
    """(fqn in ``root``, name as reported, module) for each module ``pattern`` hits."""
    for fqn, module in root.named_modules():
        if not fqn:
            continue
        qualified = f"{prefix}.{fqn}" if prefix else fqn
        if name_matches(qualified, pattern) or (prefix and name_matches(fqn, pattern)):
            yield fqn, qualified, module


def _must_hit_here(pattern: str, prefix: str) -> bool:
    return not prefix or pattern.startswith(prefix + ".")


def _import_target(target: str, origin: str):
    module_name, _, attr = target.rpartition(".")
    try:
        if not module_name:
            raise ImportError(f"{target!r} is not a dotted path (package.module.factory)")
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ReplacementError(f"{origin}: cannot import replacement target {target!r}: "
                               f"{type(exc).__name__}: {exc}") from exc
    # A factory is a Python function or class taking (module, **kwargs): builtins such as
    # os.system or eval, which would run what the recipe passes them, are not factories.
    if not (inspect.isfunction(factory) or isinstance(factory, type)):
        raise ReplacementError(f"{origin}: replacement target {target!r} is {type(factory).__name__}, "
                               f"expected a Python function or class factory(module, **kwargs)")
    return factory


def _check_module_type(module: nn.Module, name: str, entry: Mapping[str, Any], origin: str) -> None:
    expected = entry.get("module_type")
    if not expected:
        return
    exact = bool(entry.get("exact_type"))
    classes = [type(module)] if exact else type(module).__mro__
    expected_class = _import_class(expected)
    if any(cls is expected_class or expected in class_paths(cls) for cls in classes):
        return
    hint = "" if expected_class is not None else "; note: module_type does not import"
    raise ReplacementError(f"{origin}: module {name} is {class_paths(type(module))[0]}, expected "
                           f"{'exactly ' if exact else ''}{expected} (match {entry['match']!r}){hint}")


def _import_class(dotted: str) -> type | None:
    """The class a dotted path names (``torch.nn.Linear`` is defined in
    ``torch.nn.modules.linear``), or None when it does not import."""
    module_name, _, attr = dotted.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError):
        return None
    return found if isinstance(found, type) else None


def _origin(entry: Mapping[str, Any], index: int) -> str:
    if entry.get("origin"):
        return str(entry["origin"])
    return (f"plan_overrides entry with match {entry.get('match')!r} (HYPER_REPLACEMENTS[{index}] in the generated "
            f"file): replace_module._target_")


def _entry_key(entry: Mapping[str, Any]) -> str:
    fields = {k: entry.get(k) for k in ("match", "module_type", "target")} | {"kwargs": entry.get("kwargs") or {}}
    return json.dumps(fields, sort_keys=True, default=repr)


def _sample_names(root: nn.Module, prefix: str, limit: int = 4) -> str:
    names = [f"{prefix}.{fqn}" if prefix else fqn for fqn, _ in root.named_modules() if fqn]
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "") if names else "(no submodules)"
