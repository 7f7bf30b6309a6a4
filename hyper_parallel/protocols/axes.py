"""The parallel axes by name: the one module that spells them.

Every other module reads the names and their orders from here (a test greps the package
for axis-name tuples written anywhere else), so a new axis, or a new order, is one edit.

- ``SIZE_AXES``: the recipe's sizes (``accelerator.<axis>_size``), in the order messages
  and records list them;
- ``MESH_AXES``: the device mesh, outermost first. TP is innermost so its ranks are
  neighbours (fastest links); PP outermost because it communicates least. Expert
  parallelism has no axis of its own there: its ranks are borrowed from dp*cp;
- ``EXPERT_MESH_AXES``: the expert view of the same ranks, dp*cp regrouped as (edp, ep),
  ep innermost;
- ``PLACEMENT_AXES``: the axes a plan's placement may name;
- ``OVERRIDE_AXES``: the parallel forms a plan override may be conditioned on (``when:``),
  sequence parallel (``sp``, riding on tp) included.
"""

from enum import Enum


class MeshAxisName(str, Enum):
    PP = "pp"
    DP = "dp"
    CP = "cp"
    TP = "tp"
    EP = "ep"

    def __str__(self) -> str:  # so f-strings and dict keys read "tp", not "MeshAxisName.TP"
        return self.value


PP, DP, CP, TP, EP = (axis.value for axis in MeshAxisName)
EDP = "edp"  # expert data parallel: the dp*cp ranks left over per expert shard
SP = "sp"  # sequence parallel: activations split over tp between the tp regions

SIZE_AXES = (DP, CP, TP, EP, PP)
MESH_AXES = (PP, DP, CP, TP)
EXPERT_MESH_AXES = (PP, EDP, EP, TP)
PLACEMENT_AXES = (*MESH_AXES, EP)
OVERRIDE_AXES = (TP, CP, EP, SP)
