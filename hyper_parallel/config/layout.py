"""``Layout``: the parallel layout of a run as one value, made once from the recipe.

Every size (``ParallelDims``: dp, cp, tp, ep, pp, validated where they are made), sequence
and loss parallel, and the context-parallel setting as it acts at this cp size
(``ContextParallel.effective``, applied here and nowhere else). The codegen spec, the
planner, the custom backend and the bundle's records read this value; two layouts are
compared as values, and ``differences`` names the fields that differ.
"""

from dataclasses import dataclass, fields
from typing import Any

from hyper_parallel.config.context_parallel import ContextParallel
from hyper_parallel.config.parallel_dims import ParallelDims
from hyper_parallel.protocols.axes import SIZE_AXES


@dataclass(frozen=True)
class Layout:
    dims: ParallelDims = ParallelDims()
    sequence_parallel: bool = False
    loss_parallel: bool = False
    context_parallel: ContextParallel = ContextParallel()  # effective for dims.cp

    @classmethod
    def of(cls, accelerator: Any) -> "Layout":
        """The layout of a recipe's ``accelerator`` section."""
        chosen = accelerator.context_parallel
        return cls(dims=accelerator.parallel_dims, sequence_parallel=accelerator.sequence_parallel,
                   loss_parallel=accelerator.loss_parallel,
                   context_parallel=ContextParallel.effective(chosen.algorithm, chosen.load_balance,
                                                              accelerator.cp_size))

    dp = property(lambda self: self.dims.dp)
    cp = property(lambda self: self.dims.cp)
    tp = property(lambda self: self.dims.tp)
    ep = property(lambda self: self.dims.ep)
    pp = property(lambda self: self.dims.pp)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    def as_dict(self) -> dict[str, Any]:
        """The layout as signatures, the meta and the banner write it: the sizes, sp and
        loss parallel, and the context-parallel keys only where cp splits attention another
        way than gather_sequence (the method every bundle had before the keys existed,
        which therefore signs as it did)."""
        cp_keys = {"cp_algorithm": self.context_parallel.algorithm,
                   "cp_load_balance": self.context_parallel.load_balance} if self.cp > 1 and (
            self.context_parallel.algorithm != "gather_sequence") else {}
        return {**{axis: getattr(self.dims, axis) for axis in SIZE_AXES},
                "sequence_parallel": self.sequence_parallel, "loss_parallel": self.loss_parallel, **cp_keys}

    def differences(self, other: "Layout") -> list[str]:
        """The fields (each axis by its name) in which ``other`` differs from this layout."""
        differing = [axis for axis in SIZE_AXES if getattr(self.dims, axis) != getattr(other.dims, axis)]
        return differing + [f.name for f in fields(self)
                            if f.name != "dims" and getattr(self, f.name) != getattr(other, f.name)]
