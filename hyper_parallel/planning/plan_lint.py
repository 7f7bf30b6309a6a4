"""Checks a plan must pass before it is frozen. Every message names the module or
parameter (or config key), the dimension and the sizes involved."""

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Replicate, Shard

from hyper_parallel.hf_config_keys import EXPERT_COUNT_KEYS, expert_count, layer_views
from hyper_parallel.distributed.local_views import (
    LocalViewError,
    block_sizes,
    local_sizes,
    owner_of,
    packed_blocks_piece,
)
from hyper_parallel.distributed.name_match import PlanEntryConflict, match_plan_keys, placed_parameters
from hyper_parallel.distributed.state_handoff import CACHE_PARAMETERS, cache_parameter
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.protocols.placement_text import parse_placement_text
from hyper_parallel.protocols.placements import as_placement, placement_to_text

# config key -> what tp splits; each must be divisible by tp_size
_TP_SPLIT_KEYS = (
    ("num_attention_heads", "attention heads are split across tp ranks"),
    ("num_key_value_heads", "key/value heads are split across tp ranks"),
    ("intermediate_size", "the MLP intermediate dim is split across tp ranks"),
    ("moe_intermediate_size", "each expert's intermediate dim is split across tp ranks"),
    ("vocab_size", "embedding and lm_head rows (vocab) are split across tp ranks"),
)


class PlanError(ValueError, HyperParallelError):
    """A plan (derived or overridden) that cannot be applied as written."""


HEAD_KEYS = ("num_attention_heads", "num_key_value_heads")


def lint_config_divisibility(config, dims, *, whole_attention: bool = False) -> None:
    """Every size tp or ep splits divides by it, in every layer (``layer_views``); the head
    counts not where the plan leaves attention whole (``whole_attention``)."""
    problems: list[str] = []
    skip = HEAD_KEYS if whole_attention else ()
    for view in layer_views(config):
        for problem in _divisibility_problems(view, dims, skip):
            if problem not in problems:
                problems.append(problem)
    if problems:
        raise PlanError("parallel sizes do not fit the model:\n  " + "\n  ".join(problems))


def heads_not_dividing(config, tp: int) -> list[str]:
    """``key=value`` for every head count (in any layer) that tp does not divide."""
    found = []
    for view in layer_views(config):
        for key in HEAD_KEYS:
            value = getattr(view, key, None)
            if isinstance(value, int) and value % tp and f"{key}={value}" not in found:
                found.append(f"{key}={value}")
    return found


def _divisibility_problems(config, dims, skip: tuple[str, ...] = ()) -> list[str]:
    problems = []
    for key, why in _TP_SPLIT_KEYS:
        if key in skip:
            continue
        value = getattr(config, key, None)
        if isinstance(value, int) and value % dims.tp:
            problems.append(f"tp_size={dims.tp} does not divide config {key}={value} ({why})")
    if dims.ep > 1:
        found = expert_count(config)
        if found is None:
            problems.append(f"ep_size={dims.ep} but the model config has no expert count "
                            f"({' / '.join(EXPERT_COUNT_KEYS)})")
        elif found[1] % dims.ep:
            problems.append(f"ep_size={dims.ep} does not divide config {found[0]}={found[1]} "
                            "(experts are split across ep ranks)")
    return problems


def expand_plan_keys(model: nn.Module, modules: Mapping) -> dict[str, str]:
    """Module FQN -> the plan key that targets it (matched by ``name_match``, as the
    applier matches); a key matching nothing, or a module targeted by two keys, is an
    error: a plan to be frozen names each module once, so no precedence is left to apply."""
    matches = match_plan_keys((name for name, _ in model.named_modules()), modules)
    owner: dict[str, str] = {}
    for key in modules:
        hits = matches.hits[key]
        if not hits:
            raise PlanError(f"plan key {key!r} matches no module of {type(model).__name__}")
        for name in hits:
            if name in owner:
                raise PlanError(f"module {name!r} is covered by two plan entries: {owner[name]!r} and {key!r}")
            owner[name] = key
    return owner


def lint_plan(model: nn.Module, modules: Mapping, mesh) -> None:
    """Shards divide their dims; every trainable parameter is covered, by one entry
    (``name_match.placed_parameters``, the applier's reading); tied ones agree."""
    owner = expand_plan_keys(model, modules)
    for fqn, key in owner.items():
        _lint_local_views(fqn, model.get_submodule(fqn), modules[key], mesh)
        _lint_state_handoff(fqn, model.get_submodule(fqn), modules[key])
    try:
        found = placed_parameters([name for name, _ in model.named_modules()], modules)
    except PlanEntryConflict as exc:
        raise PlanError(str(exc)) from None
    placed: dict[str, dict[str, str]] = {}  # parameter FQN -> {axis: text}
    for full_name, where in found.items():
        module = model.get_submodule(where.module)
        try:
            holder, leaf = owner_of(module, where.state)
        except AttributeError:
            holder, leaf = module, where.state
        tensor = holder._parameters.get(leaf)
        if tensor is None:
            tensor = holder._buffers.get(leaf)
        if tensor is None:
            raise PlanError(f"plan entry {where.key!r} shards {where.state!r}, which is not a parameter or buffer "
                            f"of {where.module or '<root>'} ({type(module).__name__}); it has "
                            f"{sorted(module._parameters)}")
        text = {str(axis): placement_to_text(p) for axis, p in where.placement.items()}
        _lint_divides(full_name, tuple(tensor.shape), text, mesh)
        placed[full_name] = text
    _lint_coverage(model, placed)


def _lint_local_views(fqn: str, module: nn.Module, config, mesh) -> None:
    """A module run on this rank's heads: its size attributes and packed blocks divide by tp."""
    if not config.local_sizes and not config.local_slices:
        return
    tp = mesh.size("tp") if "tp" in mesh.axis_names else 1
    try:
        local_sizes(module, config.local_sizes, tp, fqn)
        for name, (dim, blocks) in config.local_slices.items():
            placed = (config.state_shardings.get(name) or {}).get("tp")
            placed = None if placed is None else as_placement(placed)
            if placed is not None and not isinstance(placed, Replicate) and placed != Shard(dim):
                raise LocalViewError(f"{name} packs blocks along dim {dim} (local_slices) but is placed {placed} over "
                                     f"tp: a packed parameter is stored shard({dim}) (packed order) or replicated")
            holder, leaf = owner_of(module, name)
            packed_blocks_piece(holder._parameters[leaf], dim, block_sizes(module, blocks, fqn), tp, 0,
                                f"{fqn}.{name}")
    except (LocalViewError, AttributeError, KeyError) as err:
        raise PlanError(f"plan entry for {fqn}: {err}") from None


def _lint_state_handoff(fqn: str, module: nn.Module, config) -> None:
    """A block handing its state on over cp computes on local pieces and takes a cache."""
    if not config.state_handoff:
        return
    if config.state_handoff != "cp" or not config.local_map:
        raise PlanError(f"plan entry for {fqn}: state_handoff {config.state_handoff!r} needs local_map and the cp "
                        "axis (the recurrent state is handed from cp rank to cp rank)")
    if cache_parameter(module) is None:
        raise PlanError(f"plan entry for {fqn}: state_handoff: cp, but {type(module).__name__}.forward takes no "
                        f"cache ({', '.join(CACHE_PARAMETERS)}) to hand the state through")


def _lint_divides(param: str, shape: tuple[int, ...], named: dict[str, str], mesh) -> None:
    for axis, text in named.items():
        allowed = getattr(mesh, "placement_axes", mesh.axis_names)
        if axis not in allowed:
            raise PlanError(f"parameter {param}: placement {text} names axis {axis!r}, "
                            f"not in mesh {list(allowed)}")
        spec = parse_placement_text(text)
        if spec.kind not in ("shard", "packed_shard"):
            continue
        dim = spec.dim + len(shape) if spec.dim < 0 else spec.dim
        if not 0 <= dim < len(shape):
            raise PlanError(f"parameter {param}: {text} on {axis!r} names dim {spec.dim}, "
                            f"but the parameter has shape {list(shape)}")
        parts = mesh.size(axis) * (spec.packs or 1)
        if shape[dim] % parts:
            packs = f" x {spec.packs} packed blocks" if spec.packs else ""
            raise PlanError(f"parameter {param}: {text} over {axis}={mesh.size(axis)}{packs} needs dim {dim} "
                            f"(size {shape[dim]}) divisible by {parts}")


def _lint_coverage(model: nn.Module, placed: dict[str, dict[str, str]]) -> None:
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            continue
        if name not in placed:
            module_name = name.rpartition(".")[0]
            kind = type(model.get_submodule(module_name)).__name__
            raise PlanError(f"trainable parameter {name} ({kind}, shape {list(param.shape)}) "
                            "is not covered by any plan entry")
        by_tensor.setdefault(id(param), []).append(name)
    for names in by_tensor.values():
        first = placed[names[0]]
        for other in names[1:]:
            if _with_replicate_dropped(placed[other]) != _with_replicate_dropped(first):
                raise PlanError(f"tied parameters {names[0]} and {other} have different placements: "
                                f"{first} vs {placed[other]}")


def _with_replicate_dropped(named: dict[str, str]) -> dict[str, str]:
    return {axis: text for axis, text in named.items() if text != "replicate"}
