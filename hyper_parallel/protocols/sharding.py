"""ShardingConfig: how one module is laid out across the device mesh.

This is the single plan format of the project. The HF planner and the
``models/common`` sharding helpers both produce it; one applier
(``hyper_parallel.distributed.applier``) consumes it.

Every placement here is a *named placement*: ``{mesh axis name: Placement}`` with
``torch.distributed.tensor`` placements (``Replicate``, ``Shard``, ``Partial``);
an axis not named is ``Replicate``.

- ``state_shardings``: parameter/buffer name (relative to the module) → named placement.
- ``in_src`` / ``in_dst``: for the module's positional inputs, how each tensor is laid
  out as it arrives (``src``) and how the module needs it (``dst``). A single named
  placement means "the first input"; a tuple gives one entry per positional input,
  ``None`` meaning "leave this input alone".
- ``out_src`` / ``out_dst``: the same for outputs (a tuple output is expanded
  explicitly, entry by entry).
- ``local_map``: the module computes on local shards (plain tensors) rather than on
  DTensors; inputs are converted to local tensors after redistribution and the
  outputs are re-wrapped with ``out_src``.
- ``local_sizes`` (local_map only): integer attributes of the module its own code
  reshapes by (a gated delta-net's ``num_v_heads``, ``key_dim``, ``conv_dim``), which
  hold this rank's share (divided by the ``tp`` size) while it runs.
- ``local_slices`` (local_map only): parameter (relative to the module; a child's is
  dotted, ``conv1d.weight``) -> ``(dim, block size attribute names)``: the parameter
  packs blocks of unequal sizes along ``dim`` (``[q | k | v]`` channels), each split
  over ``tp``; no DTensor placement says that, so it is placed ``shard(dim)`` and stored
  in packed order (each rank's piece of every block, rank after rank:
  ``distributed.local_views.PackedRows``), or placed replicated (under FSDP2) and the
  module uses this rank's piece of every block as it runs (its gradient summed over ``tp``).
- ``state_handoff`` (local_map only): a mesh axis (``cp``) along which the module, run
  on each rank's contiguous piece of the sequence, takes its recurrent state from the
  previous rank and hands its own on to the next (``distributed/state_handoff.py``).

``state_shardings`` may name a child's parameter (dotted) where the module's own code
uses it outside the child's forward (a convolution weight passed to a kernel).
"""

from dataclasses import dataclass, field
from typing import Any, Union

from hyper_parallel.protocols.axes import MeshAxisName

NamedPlacement = dict[Union[MeshAxisName, str], Any]
IOPlacement = Union[NamedPlacement, tuple[Union[NamedPlacement, None], ...], None]

# The ShardingConfig fields that place a module's inputs and outputs, in the order the
# plan format writes them (plan.json, frozen.json, the generated literal) and recipes'
# plan_overrides spell them: every site that walks them reads this one tuple.
IO_PLACEMENT_FIELDS = ("in_src", "in_dst", "out_src", "out_dst")


@dataclass(kw_only=True, slots=True)
class ShardingConfig:
    state_shardings: dict[str, NamedPlacement] = field(default_factory=dict)
    in_src: IOPlacement = None
    in_dst: IOPlacement = None
    out_src: IOPlacement = None
    out_dst: IOPlacement = None
    local_map: bool = False
    local_sizes: tuple[str, ...] = ()
    local_slices: dict[str, tuple[int, tuple[str, ...]]] = field(default_factory=dict)
    state_handoff: str = ""
