"""``Layout``: the parallel layout of a run as one value, made once from the recipe.

Every size (``ParallelDims``: dp, cp, tp, ep, pp, validated where they are made), sequence
and loss parallel, and the context-parallel setting as it acts at this cp size
(``ContextParallel.effective``, applied here and nowhere else: a ``Layout`` normalizes it
when it is made, so two layouts that split the same way are equal). The codegen spec, the
planner, the plan document, the mesh context, the custom backend and the bundle's records
carry this value; two layouts are compared as values, and ``differences`` names the
fields that differ. ``as_dict`` / ``from_dict`` are its one written form.
"""

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from hyper_parallel.config.context_parallel import DEFAULT_CP_ALGORITHM, UNWRITTEN_CP_ALGORITHM, ContextParallel
from hyper_parallel.config.parallel_dims import ParallelDims
from hyper_parallel.config.pipeline import PipelineSettings
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.protocols.axes import SIZE_AXES

_FLAGS = ("sequence_parallel", "loss_parallel")
_CP_KEYS = ("cp_algorithm", "cp_load_balance", "cp_by_default")
_PP_KEYS = ("pp_schedule", "pp_split_points", "pp_virtual_stages")


class LayoutError(ValueError, HyperParallelError):
    """A written layout that cannot be read; names where and the key."""


@dataclass(frozen=True)
class Layout:
    dims: ParallelDims = ParallelDims()
    sequence_parallel: bool = False
    loss_parallel: bool = False
    context_parallel: ContextParallel = ContextParallel()  # made effective for dims.cp
    pipeline: PipelineSettings = PipelineSettings()  # the default where pp is 1 (nothing to split)

    def __post_init__(self) -> None:
        chosen = self.context_parallel
        object.__setattr__(self, "context_parallel",
                           ContextParallel.effective(chosen.algorithm, chosen.load_balance, self.dims.cp,
                                                     chosen.by_default))
        if self.dims.pp == 1:
            object.__setattr__(self, "pipeline", PipelineSettings())

    @classmethod
    def of(cls, accelerator: Any) -> "Layout":
        """The layout of a recipe's ``accelerator`` section (an algorithm left out is
        ``DEFAULT_CP_ALGORITHM``, by default)."""
        chosen, pipeline = accelerator.context_parallel, accelerator.pipeline
        points = tuple(pipeline.split_points) if pipeline.split_points is not None else None
        return cls(dims=accelerator.parallel_dims, sequence_parallel=accelerator.sequence_parallel,
                   loss_parallel=accelerator.loss_parallel,
                   context_parallel=ContextParallel(chosen.algorithm or DEFAULT_CP_ALGORITHM, chosen.load_balance,
                                                    by_default=chosen.algorithm is None),
                   pipeline=PipelineSettings(pipeline.schedule, points, pipeline.virtual_stages))

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
        which therefore signs as it did); ``cp_by_default`` where the recipe left the
        algorithm to its default."""
        chosen = self.context_parallel
        cp_keys = {"cp_algorithm": chosen.algorithm, "cp_load_balance": chosen.load_balance,
                   **({"cp_by_default": True} if chosen.by_default else {})} if self.cp > 1 and (
            chosen.algorithm != UNWRITTEN_CP_ALGORITHM) else {}
        points = self.pipeline.split_points
        pp_keys = {"pp_schedule": self.pipeline.schedule,
                   "pp_split_points": list(points) if points is not None else None,
                   "pp_virtual_stages": self.pipeline.virtual_stages} if self.pp > 1 else {}
        return {**{axis: getattr(self.dims, axis) for axis in SIZE_AXES},
                "sequence_parallel": self.sequence_parallel, "loss_parallel": self.loss_parallel, **cp_keys,
                **pp_keys}

    @classmethod
    def from_dict(cls, data: Any, *, where: str) -> "Layout":
        """The layout ``as_dict`` wrote; any other key, a missing one or a bad value is
        refused naming ``where`` and the key."""
        if not isinstance(data, Mapping):
            raise LayoutError(f"{where}: expected an object, got {type(data).__name__}")
        known = (*SIZE_AXES, *_FLAGS, *_CP_KEYS, *_PP_KEYS)
        unknown = sorted(set(data) - set(known))
        missing = [key for key in (*SIZE_AXES, *_FLAGS) if key not in data]
        if unknown or missing:
            raise LayoutError(f"{where}: expected the keys {', '.join((*SIZE_AXES, *_FLAGS))} (and cp_algorithm, "
                              f"cp_load_balance, cp_by_default where cp splits attention; pp_schedule, pp_split_points, "
                              f"pp_virtual_stages where pp "
                              f"splits the model); "
                              f"{'missing ' + ', '.join(missing) if missing else ''}"
                              f"{'; ' if unknown and missing else ''}{'unknown ' + ', '.join(unknown) if unknown else ''}")
        for key in _FLAGS:
            if not isinstance(data[key], bool):
                raise LayoutError(f"{where}.{key}: expected true or false, got {data[key]!r}")
        if not isinstance(data.get("cp_by_default", False), bool):
            raise LayoutError(f"{where}.cp_by_default: expected true or false, got {data['cp_by_default']!r}")
        try:
            dims = ParallelDims(**{axis: data[axis] for axis in SIZE_AXES})
            chosen = ContextParallel(data.get("cp_algorithm", UNWRITTEN_CP_ALGORITHM),
                                     bool(data.get("cp_load_balance", False)), data.get("cp_by_default", False))
            points = data.get("pp_split_points")
            pipeline = PipelineSettings(data.get("pp_schedule", PipelineSettings.schedule),
                                        tuple(points) if isinstance(points, list) else points,
                                        data.get("pp_virtual_stages", 1))
        except (ValueError, TypeError) as exc:
            raise LayoutError(f"{where}: {exc}") from None
        return cls(dims=dims, sequence_parallel=data["sequence_parallel"], loss_parallel=data["loss_parallel"],
                   context_parallel=chosen, pipeline=pipeline)

    def describe(self) -> str:
        """``dp=1 cp=2 tp=2 ep=2 pp=1 sequence_parallel=True ...``: how errors name a layout."""
        return " ".join(f"{key}={value}" for key, value in self.as_dict().items())

    def differences(self, other: "Layout") -> list[str]:
        """The fields (each axis by its name) in which ``other`` differs from this layout."""
        differing = [axis for axis in SIZE_AXES if getattr(self.dims, axis) != getattr(other.dims, axis)]
        return differing + [f.name for f in fields(self)
                            if f.name != "dims" and getattr(self, f.name) != getattr(other, f.name)]
