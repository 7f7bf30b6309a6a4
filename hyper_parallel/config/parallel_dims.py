"""The parallel sizes of a run, validated once, where they are made.

One ``ParallelDims`` is built from the recipe's ``accelerator`` section
(``AcceleratorConfig.parallel_dims``) and carried from there: the codegen spec, derive,
verify, preflight, the runtime and the trainer all read this object, so the rules below
are the only definition of which sizes are valid (torchtitan's ``ParallelDims`` does the
same in ``__post_init__``).

World size is ``pp * dp * cp * tp``. Expert parallelism has no mesh axis of its own: its
ranks are borrowed from ``dp * cp``, so ``ep`` must divide ``dp * cp``.
"""

from dataclasses import dataclass

from hyper_parallel.errors import HyperParallelError
from hyper_parallel.protocols.axes import SIZE_AXES

SIZES = SIZE_AXES


class ParallelDimsError(ValueError, HyperParallelError):
    """A parallel size that cannot be: names the recipe key, what was expected, what it got."""

    def __init__(self, size: str, expected: str, got) -> None:
        self.key = f"accelerator.{size}_size"
        super().__init__(f"{self.key}: expected {expected}, got {got!r}")


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in SIZES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParallelDimsError(name, "an integer >= 1", value)
        if (self.dp * self.cp) % self.ep:
            raise ParallelDimsError("ep", f"a divisor of dp_size*cp_size = {self.dp * self.cp}", self.ep)

    def validate(self) -> "ParallelDims":
        """Kept for callers that chain it: a ``ParallelDims`` is valid once it exists."""
        return self

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in SIZES}

    def describe(self) -> str:
        """``dp=1 cp=2 tp=2 ep=2 pp=1``: how errors name a layout."""
        return " ".join(f"{name}={getattr(self, name)}" for name in SIZES)

    def active_axes(self, *, sequence_parallel: bool = False) -> frozenset[str]:
        """Names of the parallel forms in use, as ``when:`` in plan overrides spells them."""
        active = {name for name in SIZES if getattr(self, name) > 1}
        if sequence_parallel:
            active.add("sp")
        return frozenset(active)
