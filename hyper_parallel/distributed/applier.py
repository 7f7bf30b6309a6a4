"""The one applier: a plan (``{FQN or glob: ShardingConfig}``) -> DTensors and hooks.

For each planned module:

- its parameters become DTensors on the sub-mesh of the axes the entry names. Every
  rank holds the full tensor (or a meta tensor), so the local shard is sliced locally
  and wrapped with ``DTensor.from_local``; nothing is scattered.
- a forward pre-hook turns the positional inputs (plain local tensors between
  modules) into DTensors laid out as ``in_src`` and redistributes them to ``in_dst``;
  a forward hook redistributes outputs to ``out_dst`` and hands back local tensors.
- ``local_map`` modules compute on plain local tensors: inputs are unwrapped after
  redistribution and parameters are swapped for their local shards while the module
  runs. Where the module's work is split across an axis (some input or parameter is
  sharded on it), what is replicated on that axis gets a ``Partial`` gradient, so
  DTensor sums it across ranks.
- a parameter placed ``partial`` on an axis (a bias added to a partial sum, e.g. packed
  experts' ``down_proj_bias``) is stored replicated and added once over that axis
  (``_partial_parameter``).
- a parameter whose gradient arrives ``Partial`` (replicated weight, split work) is
  reduced when backward ends (``partial_grads``: one collective per bounded buffer), so
  after ``backward()`` ``param.grad`` has the parameter's placements.
- conversions that move no data forward (a replicated input to split work, a partial
  sum reduced on output) take ``boundary_collectives``: one autograd node and one
  collective, the same gradient semantics as DTensor's from_local/to_local.
- an output handed on as a local *partial* sum gets the sum's gradient on every rank.
- a redistribution that splits a dim checks that it divides evenly (e.g. the sequence
  length by cp*tp) and names the module, the dim and the sizes when it does not.
- entries that name ``ep`` live on the expert mesh (``mesh.build_expert_mesh``, built
  from the ``MeshContext``'s dims); a module whose parameters are sharded on ``ep`` gets
  the all-to-all token dispatch (``expert_dispatch``).
- when the output embedding's logits stay sharded (vocab: loss parallel; sequence:
  cp), the model's ``loss_function`` becomes the matching sharded cross entropy
  (``sharded_loss``), so HF's ``forward(labels=...)`` returns the exact loss.
- ``context_parallel`` (the plan document's): with allgather_kv the blocks planned
  ``kv_gathered_attention`` gather K/V over cp inside their attention function
  (``context_parallel.install_context_parallel``); with load balance every conversion
  that splits the sequence over cp permutes it first and every one that gathers it
  restores the order after (``_redistribute``), and the sharded loss slices its labels
  the same way.
"""

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.config.context_parallel import ContextParallel
from hyper_parallel.distributed.boundary_collectives import (
    SharedInputReductions,
    all_reduce_in_forward,
    first_rank_share,
    input_reductions,
    output_reductions,
    output_shares,
)
from hyper_parallel.distributed.context_parallel import TOKEN_ATTENTION_ROLES, SequenceOrder, install_context_parallel
from hyper_parallel.distributed.pipeline import (
    PrunedModule,
    names_only_pruned,
    pruned_names,
    whole_sequence_between_stages,
)
from hyper_parallel.distributed.expert_dispatch import install_expert_dispatch
from hyper_parallel.distributed.local_views import (  # local_piece re-exported
    PACKED_ROWS_ATTRIBUTE,
    PackedRows,
    block_sizes,
    local_piece,
    local_sizes,
    owner_of,
    packed_blocks_piece,
)
from hyper_parallel.distributed.mesh import MeshContext, build_expert_mesh
from hyper_parallel.distributed.model_parts import locate_input, output_embeddings, positional_names
from hyper_parallel.distributed.name_match import PlacedParameter, PlanEntryConflict, match_plan_keys, placed_parameters
from hyper_parallel.distributed.partial_grads import local_with_grad_placements, reduce_partial_grad
from hyper_parallel.distributed.sharded_loss import make_sharded_loss
from hyper_parallel.distributed.state_handoff import install_state_handoff
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.protocols.axes import CP, EP, TP
from hyper_parallel.protocols.placement_text import local_shard_shape  # noqa: F401  (re-exported)
from hyper_parallel.protocols.placements import as_placement
from hyper_parallel.protocols.sharding import IO_PLACEMENT_FIELDS, ShardingConfig

EP_AXIS = EP
CP_AXIS = CP


class PlanApplyError(ValueError, HyperParallelError):
    """A plan that does not fit the model or the mesh it is applied to."""


def apply_sharding_plan(model: nn.Module, modules: Mapping[str, ShardingConfig | Mapping], mesh, *,
                        single_rank_axes: bool = False, context_parallel: ContextParallel | None = None,
                        roles: Mapping[str, str] | None = None) -> nn.Module:
    """Shard ``model`` in place as ``modules`` says. An axis of one rank places nothing and
    is left out (``single_rank_axes``: keep it, so one process can exercise the DTensor
    machinery): a dp-only or cp-only run then has no tp DTensors, which model code reading
    a parameter outside its module's forward (DBRX's experts) would meet.
    ``context_parallel`` and ``roles`` (by plan key): the plan document's; without them
    attention gathers the sequence as its entries say (gather_sequence)."""
    device_mesh = mesh.device_mesh if isinstance(mesh, MeshContext) else mesh
    mesh_axes = tuple(device_mesh.mesh_dim_names or ())
    if not mesh_axes:
        raise PlanApplyError("apply_sharding_plan needs a DeviceMesh with mesh_dim_names")
    cp_size = device_mesh.size(mesh_axes.index(CP_AXIS)) if CP_AXIS in mesh_axes else 1
    order = SequenceOrder(cp_size) if context_parallel is not None and context_parallel.load_balance \
        and cp_size > 1 else None
    sub_meshes: dict[tuple[str, ...], object] = {}
    sharded: dict[int, nn.Parameter] = {}  # id(original parameter) -> DTensor parameter (tied weights)
    packed: dict[str, PackedRows] = {}  # parameters stored in packed order (local_views.PackedRows)
    shared = SharedInputReductions()
    model.register_forward_pre_hook(shared.clear)
    model.register_forward_hook(shared.clear, always_call=True)
    targets = _resolve_targets(model, modules)
    blocks = _planned_ancestors(targets)
    states = _states_by_module(targets)
    for fqn, config in targets.items():
        owner = _expert_mesh(mesh, fqn) if _names_ep(config) else device_mesh
        owner_axes = tuple(owner.mesh_dim_names)
        axes = tuple(axis for axis in _axes_of(config, owner_axes, fqn)
                     if single_rank_axes or owner.size(owner_axes.index(axis)) > 1)
        module = model.get_submodule(fqn)
        if not axes or _places_nothing(config, axes):
            for name in config.state_shardings:
                _state_parameter(module, fqn, name)  # still checked: the plan must fit the model
            continue
        key = (id(owner), axes)
        if key not in sub_meshes:
            sub_meshes[key] = owner[axes[0]] if len(axes) == 1 else owner[axes]
        _shard_states(module, fqn, config, states.get(fqn, ()), sub_meshes[key], axes, sharded, packed)
        _install_hooks(module, fqn, config, sub_meshes[key], axes, shared, block=fqn in blocks, order=order)
        if config.state_handoff and config.state_handoff in axes:
            _install_state_handoff(module, fqn, config, owner, order)
        if _shards_states_on(config, EP_AXIS):
            install_expert_dispatch(module, fqn, owner.get_group(EP_AXIS), owner.size(owner_axes.index(EP_AXIS)))
        if module is output_embeddings(model):
            _install_sharded_loss(model, fqn, config, sub_meshes[key], axes, order)
    if context_parallel is not None and context_parallel.splits_attention and cp_size > 1:
        attention = _token_attention(model, modules, roles or {})
        if not attention and (roles is None or not context_parallel.by_default):
            raise PlanApplyError(f"context_parallel.algorithm {context_parallel.algorithm}: the plan has no "
                                 f"{' or '.join(TOKEN_ATTENTION_ROLES)} entry (pass the plan document's roles); "
                                 "regenerate the bundle")
        if attention:  # none where the default algorithm left every attention block gathered
            install_context_parallel(model, attention, device_mesh, order, algorithm=context_parallel.algorithm)
    elif cp_size > 1 and set(TOKEN_ATTENTION_ROLES) & set((roles or {}).values()):
        # attention on local queries and local K/V only would be silently wrong
        raise PlanApplyError("the plan keeps each cp rank's tokens through attention but no context_parallel "
                             "settings came with it; pass the plan document's context_parallel to "
                             "apply_sharding_plan")
    if packed:
        model.__dict__.setdefault(PACKED_ROWS_ATTRIBUTE, {}).update(packed)
    return model


def _token_attention(model: nn.Module, modules: Mapping, roles: Mapping[str, str]) -> list[str]:
    """The FQNs of the blocks the plan keeps on the rank's tokens through attention."""
    matches = match_plan_keys((name for name, _ in model.named_modules()), modules)
    return sorted(name for name, key in matches.applied.items() if roles.get(key) in TOKEN_ATTENTION_ROLES)


def _planned_ancestors(targets: Mapping[str, ShardingConfig]) -> set[str]:
    """FQNs of planned modules' ancestors: blocks whose planned submodules convert the
    inputs they see themselves. A submodule that neither places a parameter nor converts
    an input (an identity expert handing on its share of a partial sum) leaves that to its
    parent: the experts still reduce their own inputs' gradients."""
    ancestors = set()
    for fqn, config in targets.items():
        if fqn and (config.state_shardings or any(config.in_src or ()) or any(config.in_dst or ())):
            parts = fqn.split(".")
            ancestors.update(".".join(parts[:index]) for index in range(len(parts)))
    return ancestors


def _names_ep(config: ShardingConfig) -> bool:
    return any(str(axis) == EP_AXIS for named in _named_entries(config) for axis in named)


def _shards_states_on(config: ShardingConfig, axis: str) -> bool:
    return any(isinstance(as_placement(p), (Shard, _StridedShard))
               for named in config.state_shardings.values() for a, p in named.items() if str(a) == axis)


def _expert_mesh(mesh, fqn: str):
    """Entries that name ``ep`` live on the expert mesh (ranks borrowed from dp*cp)."""
    if not isinstance(mesh, MeshContext):
        raise PlanApplyError(f"plan entry {fqn!r} names the ep axis: apply the plan with a MeshContext "
                             "(device mesh and parallel dims), from which the expert mesh is built")
    if mesh.expert_mesh is None:
        mesh.expert_mesh = build_expert_mesh(mesh.dims, mesh.device_mesh.device_type)
    return mesh.expert_mesh


# --- which modules ---------------------------------------------------------------------------


def _resolve_targets(model: nn.Module, modules: Mapping) -> dict[str, ShardingConfig]:
    """Expand globs to exact FQNs by the one precedence rule (``name_match``): an exact key
    beats a glob for the same module; among globs the last one wins."""
    matches = match_plan_keys((name for name, _ in model.named_modules()), modules)
    pruned = pruned_names(model)  # a pipeline stage's: what other stages run
    configs: dict[str, ShardingConfig] = {}
    for key, config in modules.items():
        configs[key] = _as_config(config, key)
        if not matches.hits[key] and not names_only_pruned(key, pruned):
            raise PlanApplyError(f"plan key {key!r} matches no module of {type(model).__name__}")
    resolved = whole_sequence_between_stages(model, {name: configs[key] for name, key in matches.applied.items()})
    return {name: config for name, config in resolved.items()
            if not isinstance(model.get_submodule(name), PrunedModule)}


def _states_by_module(targets: Mapping[str, ShardingConfig]) -> dict[str, list[PlacedParameter]]:
    """Per planned module, the parameters its entry places, read as every check reads them
    (``name_match.placed_parameters``): a parameter two entries place is refused here, as
    plan lint and preflight refuse it, instead of going to whichever entry comes first."""
    try:
        placed = placed_parameters(targets, targets)
    except PlanEntryConflict as exc:
        raise PlanApplyError(str(exc)) from None
    states: dict[str, list[PlacedParameter]] = {}
    for where in placed.values():
        states.setdefault(where.module, []).append(where)
    return states


def _as_config(config, key: str) -> ShardingConfig:
    if isinstance(config, ShardingConfig):
        return config
    if isinstance(config, Mapping):
        from hyper_parallel.distributed.plan_format import sharding_config_from_json

        return sharding_config_from_json({k: v for k, v in config.items()}, where=f"plan[{key!r}]")
    raise PlanApplyError(f"plan[{key!r}]: expected a ShardingConfig or a mapping, got {type(config).__name__}")


def _named_entries(config: ShardingConfig):
    yield from config.state_shardings.values()
    for key in IO_PLACEMENT_FIELDS:
        for named in _io_list(getattr(config, key)):
            if named is not None:
                yield named


def _io_list(value) -> tuple:
    if value is None:
        return ()
    if isinstance(value, Mapping):
        return (value,)
    return tuple(value)


def _axes_of(config: ShardingConfig, mesh_axes: tuple[str, ...], fqn: str) -> tuple[str, ...]:
    named_axes = {str(axis) for named in _named_entries(config) for axis in named}
    unknown = sorted(named_axes - set(mesh_axes))
    if unknown:
        raise PlanApplyError(f"plan entry {fqn!r} names mesh axes {unknown}; the mesh has {list(mesh_axes)}")
    return tuple(axis for axis in mesh_axes if axis in named_axes)


def _placements(named, axes: tuple[str, ...], ndim: int | None = None) -> tuple:
    """Named placement -> one torch placement per axis; negative shard dims resolved on ``ndim``."""
    by_axis = {str(axis): as_placement(p) for axis, p in named.items()}
    out = []
    for axis in axes:
        placement = by_axis.get(axis, Replicate())
        if ndim is not None and isinstance(placement, (Shard, _StridedShard)) and placement.dim < 0:
            placement = (_StridedShard(placement.dim + ndim, split_factor=placement.split_factor)
                         if isinstance(placement, _StridedShard) else Shard(placement.dim + ndim))
        out.append(placement)
    return tuple(out)


# --- parameters ------------------------------------------------------------------------------


def _shard_states(module: nn.Module, fqn: str, config: ShardingConfig, states, sub_mesh, axes, sharded,
                  packed: dict[str, PackedRows]) -> None:
    """The parameters ``states`` (``PlacedParameter``s of this module's entry) as DTensors."""
    for where in states:
        name, named = where.state, where.placement
        param = _state_parameter(module, fqn, name)
        if id(param) not in sharded:
            if isinstance(param, DTensor):
                raise PlanApplyError(f"parameter {fqn}.{name} is already a DTensor; was the plan applied twice?")
            placements = _placements(named, axes, param.dim())
            if any(isinstance(p, Partial) for p in placements) and not config.local_map:
                raise PlanApplyError(f"plan entry {fqn!r} places {name!r} partial, which only a local_map "
                                     "entry can use (as the local tensor it adds to a partial sum)")
            rows = _packed_rows(module, fqn, name, config, placements, sub_mesh, axes)
            if rows is not None:
                packed[f"{fqn}.{name}" if fqn else name] = rows
            sharded[id(param)] = _to_dtensor_parameter(param, _stored_placements(placements), sub_mesh, rows)
        owner, leaf = owner_of(module, name)
        owner._parameters[leaf] = sharded[id(param)]


def _packed_rows(module: nn.Module, fqn: str, name: str, config: ShardingConfig, placements, sub_mesh,
                 axes) -> PackedRows | None:
    """How a parameter packing unequal blocks (``local_slices``) is stored when the plan
    shards it over tp (``local_views.PackedRows``); None for every other parameter (one
    with ``local_slices`` stored replicated takes its piece while its module runs)."""
    if name not in config.local_slices or TP not in axes:
        return None
    dim, blocks = config.local_slices[name]
    mesh_dim = axes.index(TP)
    placement = placements[mesh_dim]
    if not isinstance(placement, Shard):
        return None
    where = fqn or "<root>"
    if isinstance(placement, _StridedShard) or placement.dim != dim or any(
            isinstance(p, Shard) and p.dim == dim for i, p in enumerate(placements) if i != mesh_dim):
        raise PlanApplyError(f"plan entry {where!r}: {name!r} packs blocks along dim {dim} (local_slices) but is "
                             f"placed {tuple(placements)}; a packed parameter is stored shard({dim}) over tp and "
                             "split along no other mesh dim, or replicated")
    return PackedRows(dim, tuple(block_sizes(module, blocks, where)), sub_mesh.size(mesh_dim), mesh_dim)


def _places_nothing(config: ShardingConfig, axes) -> bool:
    """An entry that replicates its parameters and converts nothing: its module reads
    whole inputs, so its gradients are whole on every rank and its parameters can stay
    plain tensors (model code may read them outside the module's forward, where a DTensor
    would meet plain tensors: DBRX's experts slice their GLU's matrices)."""
    if any(getattr(config, key) is not None for key in IO_PLACEMENT_FIELDS):
        return False
    return all(isinstance(placement, Replicate)
               for named in config.state_shardings.values() for placement in _placements(named, axes))


def _state_parameter(module: nn.Module, fqn: str, name: str) -> nn.Parameter:
    """The parameter ``name`` of ``module`` that a plan entry places: its own, or a child's
    (dotted) that the module's own code uses outside the child's forward."""
    try:
        owner, leaf = owner_of(module, name)
    except AttributeError:
        owner, leaf = None, name
    param = None if owner is None else owner._parameters.get(leaf)
    if param is None:
        if owner is not None and leaf in owner._buffers:
            raise PlanApplyError(f"plan entry {fqn!r}: buffer {name!r} sharding is not supported yet")
        raise PlanApplyError(
            f"plan entry {fqn!r} shards {name!r}, which is not a parameter of "
            f"{type(module).__name__} (has {sorted(module._parameters)})")
    return param


def _stored_placements(placements) -> tuple:
    """A parameter placed ``partial`` is stored whole (replicated) on that axis."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _to_dtensor_parameter(param: nn.Parameter, placements, sub_mesh, rows: PackedRows | None = None) -> nn.Parameter:
    """The parameter as a DTensor holding this rank's piece (in packed order where
    ``rows`` says so)."""
    coords = sub_mesh.get_coordinate()
    local = param.detach()
    for placement, coord, mesh_dim in zip(placements, coords, range(sub_mesh.ndim)):
        if rows is not None and mesh_dim == rows.mesh_dim:
            local = packed_blocks_piece(local, rows.dim, list(rows.sizes), rows.pieces, coord, "parameter")
        else:
            local = local_piece(local, placement, sub_mesh.size(mesh_dim), coord)
    local = local.clone()  # own the shard's memory rather than view the full tensor
    dtensor = DTensor.from_local(local, sub_mesh, placements, run_check=False,
                                 shape=param.shape, stride=param.stride())
    new_param = nn.Parameter(dtensor, requires_grad=param.requires_grad)
    if new_param.requires_grad:
        new_param.register_post_accumulate_grad_hook(reduce_partial_grad)
    return new_param


# --- forward hooks ---------------------------------------------------------------------------


def _install_state_handoff(module: nn.Module, fqn: str, config: ShardingConfig, mesh,
                           order: SequenceOrder | None) -> None:
    """A recurrent block run on each rank's piece, its state handed on along the entry's
    ``state_handoff`` axis (``state_handoff.py``): after the entry's own input conversions
    (so it sees the local piece), before its output's."""
    axis = config.state_handoff
    if order is not None:
        raise PlanApplyError(f"plan entry {fqn!r} hands its state on over {axis}, which needs each rank's piece of "
                             "the sequence contiguous, but context_parallel.load_balance reorders them; regenerate "
                             "the bundle (the planner gathers such blocks under load balancing)")
    stream = next((index for index, dst in enumerate(_io_list(config.in_dst))
                   if dst is not None and dst.get(axis) is not None and isinstance(as_placement(dst[axis]), Shard)),
                  None)
    if stream is None:
        raise PlanApplyError(f"plan entry {fqn!r} hands its state on over {axis}, but none of its inputs is split "
                             f"over {axis} (in_dst {config.in_dst}); regenerate the bundle")
    install_state_handoff(module, mesh.get_group(axis), stream_index=stream, where=fqn or "<root>")


def _install_hooks(module: nn.Module, fqn: str, config: ShardingConfig, sub_mesh, axes,
                   shared: SharedInputReductions, *, block: bool = False, order: SequenceOrder | None = None) -> None:
    in_pairs = _pairs(config.in_src, config.in_dst)
    out_pairs = _pairs(config.out_src, config.out_dst)
    arg_names = positional_names(module)
    split_axes = _split_axes(config, axes) if config.local_map else frozenset()
    # A block (planned submodules) hands its inputs to them, whose boundaries reduce the
    # gradients of the split work; its own sharded parameters (an attention block's sinks,
    # split with the heads) do not touch its inputs, so they do not make them partial.
    input_split_axes = _split_axes(config, axes, with_states=False) if config.local_map and block else split_axes

    def pre_hook(mod, args, kwargs):
        args, kwargs = list(args), dict(kwargs)
        for index, (src, dst) in enumerate(in_pairs):
            if src is None and dst is None:
                continue
            where, key = locate_input(index, args, kwargs, arg_names)
            if where is None:
                continue
            value = where[key]
            if isinstance(value, torch.Tensor):
                where[key] = _convert_input(value, src, dst, sub_mesh, axes, config.local_map, input_split_axes,
                                            f"{fqn or '<root>'} input {index}", shared, order)
        return tuple(args), kwargs

    def post_hook(mod, args, kwargs, output):
        return _convert_outputs(output, out_pairs, sub_mesh, axes, fqn or "<root>", order)

    if config.local_map:
        _install_local_parameter_swap(module, fqn, config, sub_mesh, axes, split_axes)
    if any(src is not None or dst is not None for src, dst in in_pairs):
        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    if any(src is not None or dst is not None for src, dst in out_pairs):
        module.register_forward_hook(post_hook, with_kwargs=True)


def _pairs(src, dst) -> list[tuple]:
    src, dst = _io_list(src), _io_list(dst)
    length = max(len(src), len(dst))
    src = src + (None,) * (length - len(src))
    dst = dst + (None,) * (length - len(dst))
    return list(zip(src, dst))


def _split_axes(config: ShardingConfig, axes, *, with_states: bool = True) -> frozenset[str]:
    """Axes along which a local_map module's work is split: something it sees is sharded, or
    it hands on a piece of its output from what every rank sees whole (``colwise_by_parent``,
    whose weight its parent slices)."""
    named = (list(config.state_shardings.values()) if with_states else []) + [
        n for n in (*_io_list(config.in_dst), *_io_list(config.out_src)[:1]) if n is not None]
    return frozenset(str(axis) for entry in named for axis, p in entry.items()
                     if isinstance(as_placement(p), (Shard, _StridedShard)))


def _grad_placements(placements, axes, split_axes) -> tuple:
    """What is replicated along a split axis only sees part of the work: its gradient is Partial."""
    return tuple(Partial() if isinstance(p, Replicate) and axis in split_axes else p
                 for p, axis in zip(placements, axes))


def _convert_input(value, src, dst, sub_mesh, axes, local_map: bool, split_axes, where: str,
                   shared: SharedInputReductions, order: SequenceOrder | None = None):
    ndim = value.dim()
    if local_map and src is not None and not isinstance(value, DTensor):
        src_placements = _placements(src, axes, ndim)
        dst_placements = src_placements if dst is None else _placements(dst, axes, ndim)
        reduce = input_reductions(src_placements, dst_placements,
                                  _grad_placements(dst_placements, axes, split_axes))
        if reduce is not None:  # no data moves forward: at most a gradient all-reduce
            return shared.all_reduce_in_backward(value, _groups(sub_mesh, reduce))
    if not isinstance(value, DTensor):
        if src is None:
            raise PlanApplyError(f"{where} has in_dst {dst} but no in_src, and arrived as a plain tensor")
        value = DTensor.from_local(value, sub_mesh, _placements(src, axes, ndim), run_check=False)
    if dst is not None:
        value = _redistribute(value, sub_mesh, _placements(dst, axes, ndim), axes, where, order)
    if local_map:
        return value.to_local(grad_placements=_grad_placements(value.placements, axes, split_axes))
    return value


def _groups(sub_mesh, mesh_dims) -> list:
    return [sub_mesh.get_group(dim) for dim in mesh_dims if sub_mesh.size(dim) > 1]


def _redistribute(value: DTensor, sub_mesh, placements, axes, where: str,
                  order: SequenceOrder | None = None) -> DTensor:
    _check_even_split(tuple(value.shape), placements, sub_mesh, axes, where)
    if order is None or CP_AXIS not in axes:
        return value.redistribute(sub_mesh, placements)
    index = axes.index(CP_AXIS)
    was_split, splits = _on_sequence(value.placements[index]), _on_sequence(placements[index])
    if not was_split and splits:  # the whole sequence split over cp: into the balanced order first
        value = _reordered(value, order.permute, where)
    value = value.redistribute(sub_mesh, placements)
    if was_split and not splits:  # gathered over cp: back into the natural order
        value = _reordered(value, order.restore, where)
    return value


def _on_sequence(placement) -> bool:
    return isinstance(placement, Shard) and placement.dim == 1


def _reordered(value: DTensor, reorder, where: str) -> DTensor:
    """``value`` with its sequence dim (1) reordered, which no mesh dim may split here."""
    if any(isinstance(p, (Shard, _StridedShard)) and p.dim == 1 for p in value.placements):
        raise PlanApplyError(f"{where}: load-balanced context parallel reorders the whole sequence where it is "
                             f"split or gathered over cp, but it is split over another axis too "
                             f"({list(value.placements)}); set accelerator.context_parallel.load_balance: false")
    grads = tuple(Replicate() if isinstance(p, Partial) else p for p in value.placements)
    local = reorder(value.to_local(grad_placements=grads), 1)
    return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def _check_even_split(shape, placements, sub_mesh, axes, where: str) -> None:
    """Plans assume even shards (e.g. the sequence over cp*tp): an uneven split is an error
    that names the module, the dim and the sizes, not a silent mis-shard further on."""
    pieces: dict[int, list[str]] = {}
    for index, (axis, placement) in enumerate(zip(axes, placements)):
        if isinstance(placement, Shard) and sub_mesh.size(index) > 1:
            pieces.setdefault(placement.dim, []).append(axis)
    for dim, split_axes in pieces.items():
        count = 1
        for axis in split_axes:
            count *= sub_mesh.size(axes.index(axis))
        if shape[dim] % count:
            sizes = "*".join(f"{axis}={sub_mesh.size(axes.index(axis))}" for axis in split_axes)
            what = "sequence length" if dim == 1 else "size"
            product = f"={count}" if len(split_axes) > 1 else ""
            raise PlanApplyError(f"{where}: dim {dim} ({what} {shape[dim]}) of a tensor of shape {list(shape)} "
                                 f"must be divisible by {sizes}{product}, over which the plan splits it")


def _convert_outputs(output, out_pairs, sub_mesh, axes, where: str, order: SequenceOrder | None = None):
    if isinstance(output, (tuple, list)):
        pairs = out_pairs + [(None, None)] * (len(output) - len(out_pairs))
        converted = [_convert_output(item, src, dst, sub_mesh, axes, f"{where} output {index}", order)
                     for index, (item, (src, dst)) in enumerate(zip(output, pairs))]
        return converted if isinstance(output, list) else tuple(converted)
    src, dst = out_pairs[0]
    return _convert_output(output, src, dst, sub_mesh, axes, f"{where} output 0", order)


def _convert_output(value, src, dst, sub_mesh, axes, where: str, order: SequenceOrder | None = None):
    if not isinstance(value, torch.Tensor) or (src is None and dst is None):
        return value
    ndim = value.dim()
    if not isinstance(value, DTensor):
        if src is None:
            return value
        src_placements = _placements(src, axes, ndim)
        dst_placements = src_placements if dst is None else _placements(dst, axes, ndim)
        reduce = output_reductions(src_placements, dst_placements)
        if reduce is not None:  # at most a partial sum reduced: one all-reduce, gradient unchanged
            return all_reduce_in_forward(value, _groups(sub_mesh, reduce))
        shares = output_shares(src_placements, dst_placements)
        if shares is not None:  # a whole value made one term of a partial sum: no data moves
            return first_rank_share(value, sub_mesh.get_coordinate(), shares)
        value = DTensor.from_local(value, sub_mesh, src_placements, run_check=False)
    if dst is not None:
        value = _redistribute(value, sub_mesh, _placements(dst, axes, ndim), axes, where, order)
    # A partial sum handed on as a local tensor: its gradient is the sum's, on every rank.
    grads = tuple(Replicate() if isinstance(p, Partial) else p for p in value.placements)
    local = value.to_local(grad_placements=grads)
    # to_local's result is a view made inside a custom autograd Function, which autograd
    # forbids modifying in place; model code does that to what a module hands it (CTRL:
    # ``inputs_embeds *= sqrt(d_model)``), so it gets a tensor of its own.
    return local.clone() if local.requires_grad else local


def _install_local_parameter_swap(module: nn.Module, fqn: str, config: ShardingConfig, sub_mesh, axes,
                                  split_axes) -> None:
    """While a local_map module runs, its parameters are their local shards (differentiably).
    A parameter the module hands out as an output (GPT-NeoX-Japanese's attention returns
    its ``dense_bias``, which the decoder layer adds) is used where the module's first
    output goes: on each rank's piece of the sequence, if that output is split along it,
    so its gradient there is a partial sum over those axes. A module computed on this
    rank's heads also gets its ``local_slices`` (this rank's piece of each packed block of a
    replicated parameter) and its ``local_sizes`` (``local_views``)."""
    names = [name for name in config.state_shardings
             if isinstance(_state_parameter(module, fqn, name), DTensor)]
    partial_dims = {name: tuple(dim for dim, p in enumerate(_placements(config.state_shardings[name], axes))
                                if isinstance(p, Partial))
                    for name in names}
    handed_on = _io_list(config.out_dst) or _io_list(config.out_src)
    pieces, index = _tp_share(sub_mesh, axes)
    where = fqn or "<root>"
    saved: list[tuple[dict, dict, dict]] = []
    grad_specs: dict = {}

    def swap_in(mod, args):
        originals, swapped = {}, {}
        for name in names:
            owner, leaf = owner_of(mod, name)
            param = originals[name] = owner._parameters[leaf]
            grads = _grad_placements(param.placements, axes, split_axes)
            if partial_dims[name]:
                local = _partial_parameter(param, partial_dims[name], grads, grad_specs)
            else:
                local = local_with_grad_placements(param, grads, grad_specs)
            if name in config.local_slices and not (TP in axes and isinstance(param.placements[axes.index(TP)], Shard)):
                dim, blocks = config.local_slices[name]  # stored replicated: this rank's piece now
                local = packed_blocks_piece(local, dim, block_sizes(mod, blocks, where), pieces, index,
                                            f"{where}.{name}")
            owner._parameters[leaf] = local
            swapped[id(local)] = name
        sizes = {name: getattr(mod, name) for name in config.local_sizes}
        for name, value in local_sizes(mod, config.local_sizes, pieces, where).items():
            setattr(mod, name, value)
        saved.append((originals, swapped, sizes))

    def swap_out(mod, args, output):
        if not saved:
            return None
        originals, swapped, sizes = saved.pop()
        for name, param in originals.items():
            owner, leaf = owner_of(mod, name)
            owner._parameters[leaf] = param
        for name, value in sizes.items():
            setattr(mod, name, value)
        if not isinstance(output, (tuple, list)) or not handed_on or handed_on[0] is None:
            return None
        split_where_used = {axis for axis, p in zip(axes, _placements(handed_on[0], axes)) if isinstance(p, Shard)}
        if not any(id(item) in swapped for item in output) or not split_where_used:
            return None
        items = [_handed_out(originals[swapped[id(item)]], axes, split_where_used) if id(item) in swapped else item
                 for item in output]
        return items if isinstance(output, list) else tuple(items)

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(swap_out, always_call=True)


def _tp_share(sub_mesh, axes) -> tuple[int, int]:
    """(tp size, this rank's tp coordinate) on the entry's sub-mesh; (1, 0) without tp."""
    if TP not in axes:
        return 1, 0
    dim = axes.index(TP)
    return sub_mesh.size(dim), sub_mesh.get_coordinate()[dim]


def _handed_out(param: DTensor, axes, split_where_used: set[str]) -> torch.Tensor:
    """A parameter's local value for code running on pieces along ``split_where_used``:
    its gradient there is a partial sum over those axes (summed when backward ends)."""
    grads = tuple(Partial() if axis in split_where_used and isinstance(p, Replicate) else p
                  for p, axis in zip(param.placements, axes))
    return param.to_local(grad_placements=grads)


def _partial_parameter(param: DTensor, mesh_dims: tuple[int, ...], grads: tuple, grad_specs: dict) -> torch.Tensor:
    """The local value of a parameter placed ``partial`` on ``mesh_dims``: a term of the
    module's partial-sum output (packed experts' ``down_proj_bias``: each tp rank's output
    is its slice of the down projection, all-reduced on the way out), so the sum must see
    it once. The first rank of each such mesh dim uses the whole value, the others a zero
    (``value * 0``, so that they still get a gradient, of zeros); the gradient is marked
    ``Partial`` there (``grads`` has the other dims', e.g. cp's where the tokens are
    split) and summed over the dims when backward ends (``partial_grads``; ``grad_specs``
    is the module's cache for ``local_with_grad_placements``).

    This is exact: the all-reduced output is ``sum of the slices + bias`` as in one
    process, and the summed gradient is ``g + 0 + ...`` = ``g``, the first rank's
    gradient, which is the one-process gradient (its output gradient is the replicated
    sum's), bit for bit for any tp.
    DTensor's own Replicate -> Partial (each rank ``bias / n``) would round for an ``n``
    that is not a power of two. The parameter itself stays stored whole and replicated,
    so the optimizer steps the true bias on every rank, the checkpoint load reads it
    whole and the gradient norm counts it once."""
    mesh = param.device_mesh
    coords = mesh.get_coordinate()
    grads = tuple(Partial() if dim in mesh_dims else p for dim, p in enumerate(grads))
    local = local_with_grad_placements(param, grads, grad_specs)
    first = all(coords[dim] == 0 for dim in mesh_dims)
    return local if first else local * 0


# --- loss on sharded logits ------------------------------------------------------------------


def _install_sharded_loss(model: nn.Module, fqn: str, config: ShardingConfig, sub_mesh, axes,
                          order: SequenceOrder | None = None) -> None:
    """Logits left sharded (vocab and/or sequence) go into a loss that knows it."""
    outputs = _io_list(config.out_dst) or _io_list(config.out_src)
    if not outputs or outputs[0] is None:
        return
    placements = _placements(outputs[0], axes, 3)
    if not any(isinstance(p, Shard) for p in placements):
        return
    if not hasattr(model, "loss_function"):
        raise PlanApplyError(f"plan entry {fqn!r} leaves the logits sharded {placements}, but "
                             f"{type(model).__name__} has no loss_function to make sharding-aware")
    model.loss_function = make_sharded_loss(sub_mesh, axes, placements, order=order)


def reinstall_grad_hooks(model: nn.Module) -> int:
    """Register the gradient-placement hook on every DTensor parameter again.

    ``model.to_empty()`` (materializing a meta-device model) replaces DTensor parameters
    with new Parameter objects, which drops hooks registered on the old ones."""
    count = 0
    for param in model.parameters():
        if isinstance(param, DTensor):
            # to_empty swaps tensor internals (torch.utils.swap_tensors): the Python-side hook
            # dict survives but the autograd registration behind it does not. Clearing the
            # dict makes the next registration install it again.
            param._post_accumulate_grad_hooks = None
            if param.requires_grad:  # a frozen parameter (AFMoE's expert_bias) takes no hook
                param.register_post_accumulate_grad_hook(reduce_partial_grad)
            count += 1
    return count
