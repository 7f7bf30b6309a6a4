"""The dataflow's facts in the planned model's names.

The dataflow is traced on a tiny copy of the model (``dataflow.py``); the planner plans
the full model. ``TracedNames`` answers the planner's questions (which modules feed
attention, pick experts, add the stream themselves, hand their state on under cp ...) in
the full model's module names, each through the traced modules that stand for it
(``stand_ins.py``), and builds the plan entry of a block's parent split on its heads.
"""

from torch import nn
from torch.distributed.tensor import Shard

from hyper_parallel.planning.dataflow import Dataflow
from hyper_parallel.planning.linear_blocks import SPLIT_MODE
from hyper_parallel.planning.plan_lint import PlanError
from hyper_parallel.planning.sequence_layout import TracedFacts
from hyper_parallel.planning.stand_ins import StandIns
from hyper_parallel.protocols.axes import TP
from hyper_parallel.protocols.sharding import ShardingConfig


class TracedNames:
    """What the dataflow saw (``Dataflow``, in the traced copy's names) asked in the planned
    model's names, by stand-in (``StandIns``); empty answers without a dataflow."""

    def __init__(self, model: nn.Module, dataflow: Dataflow | None):
        self.model = model
        self.dataflow = dataflow
        self._attention_feeders: frozenset[str] | None = None

    def routers(self) -> frozenset[str]:
        """The model's linears the dataflow saw pick experts (by stand-in)."""
        if self.dataflow is None:
            return frozenset()
        picking = StandIns(self.dataflow.routers)
        return frozenset(name for name, _ in self.model.named_modules() if name and picking(name))

    def stand_ins(self, field: str) -> frozenset[str]:
        """The model's modules that stand in (by name pattern) for the traced copy's modules
        in ``Dataflow.<field>`` (``outside_sums``, ``flat_outputs``)."""
        if self.dataflow is None:
            return frozenset()
        traced = StandIns(getattr(self.dataflow, field))
        return frozenset(name for name, _ in self.model.named_modules() if name and traced(name))

    def facts(self) -> TracedFacts:
        """What the trace saw, in this model's names (empty without a trace)."""
        if self.dataflow is None:
            return TracedFacts()
        return TracedFacts(attention_inputs=self.attention_inputs(), outside_sums=self.stand_ins("outside_sums"),
                           routers=self.routers(), flat_outputs=self.stand_ins("flat_outputs"),
                           flat_inputs=self.stand_ins("flat_inputs"), after_layers=self.stand_ins("after_layers"),
                           layer_readers=self.stand_ins("layer_readers"),
                           value_inputs=self.by_stand_in("value_inputs"),
                           value_outputs=self.by_stand_in("value_outputs"),
                           reads=self.dataflow.reads, split_error=self.dataflow.sequence_split_error,
                           whole_after_layers=self.dataflow.whole_after_layers,
                           split_layer_inputs=self.dataflow.split_layer_inputs,
                           misplaced_hand_outs=self.by_stand_in("misplaced_hand_outs"),
                           read_outside=self.stand_ins("read_outside"),
                           after_layers_called_again=self.stand_ins("after_layers_called_again"),
                           state_handoff=self.same_class_stand_ins("state_handoff"),
                           handoff_refusals=self.by_stand_in("handoff_refusals"),
                           token_attention_refusals=self.by_stand_in("token_attention_refusals", same_class=True),
                           traced=True)

    def same_class_stand_ins(self, field: str) -> frozenset[str]:
        """``_stand_ins`` by stand-ins of the module's own class only: a hybrid's ``self_attn``
        is a linear attention in one layer and softmax attention in the next."""
        if self.dataflow is None:
            return frozenset()
        traced = StandIns(getattr(self.dataflow, field))
        return frozenset(name for name, module in self.model.named_modules()
                         if name and any(self.dataflow.same_class(other, module) for other in traced(name)))

    def by_stand_in(self, field: str, *, same_class: bool = False) -> dict:
        """The model's modules -> what ``Dataflow.<field>`` says of their stand-ins: the
        positions of their inputs (``value_inputs``) or outputs (``value_outputs``) that
        carried the stream, how they hand out a parameter (``misplaced_hand_outs``); with
        ``same_class``, of stand-ins of the module's own class only."""
        if self.dataflow is None:
            return {}
        facts = getattr(self.dataflow, field)
        traced = StandIns(facts)
        found = {}
        for name, module in self.model.named_modules():
            stand_ins = traced(name) if name else []
            if same_class:
                stand_ins = [other for other in stand_ins if self.dataflow.same_class(other, module)]
            if stand_ins:
                found[name] = facts[stand_ins[0]]
        return found

    def attention_inputs(self) -> frozenset[str]:
        """The model's modules whose output reaches an attention's q, k or v (by pattern)."""
        if self.dataflow is None:
            return frozenset()
        if self._attention_feeders is None:
            feeding = StandIns(self.dataflow.attention_inputs)
            self._attention_feeders = frozenset(name for name, _ in self.model.named_modules()
                                                if name and feeding(name))
        return self._attention_feeders

    def head_split_entry(self, fqn: str, *, dp: int) -> ShardingConfig:
        """The entry of a block's parent computed on this rank's heads (``HeadSplit``): its
        other parameters as the heads they serve need them, its size attributes local."""
        splits = {block.heads.name: block.heads for block in self.dataflow.blocks
                  if block.heads is not None and block.mode == SPLIT_MODE}
        module = self.model.get_submodule(fqn)
        found = {id(splits[name]): splits[name] for name in StandIns(splits)(fqn)
                 if self.dataflow.same_class(name, module)}
        if len(found) != 1:
            raise PlanError(f"cannot plan {fqn} on its heads: the traced copy has {len(found)} modules standing "
                            "for it")
        split = next(iter(found.values()))
        states = {name: {TP: placement} for name, placement in split.states.items()}
        if dp == 1:
            # A packed parameter of unequal blocks is stored sharded, in packed order
            # (local_views.PackedRows). Under FSDP2, which splits its rows again over dp,
            # it stays replicated over tp and each rank takes its piece as it runs.
            states.update({name: {TP: Shard(dim)} for name, (dim, _) in split.slices.items()})
        return ShardingConfig(state_shardings=states, local_map=True, local_sizes=split.sizes,
                              local_slices=dict(split.slices))
