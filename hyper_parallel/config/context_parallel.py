"""The context parallel settings as codegen and the planner carry them (torch-free).

``ContextParallel`` is the effective form of the recipe's ``accelerator.context_parallel``
for a layout: with ``cp_size`` 1 there is nothing to split, and only ``allgather_kv``
has a load balance (``gather_sequence`` computes the whole sequence on every rank,
``ulysses`` every head group's whole sequence), so the others normalize to
``load_balance: False``; two recipes that split the same way then sign the same.
"""

from dataclasses import dataclass

from hyper_parallel.errors import HyperParallelError

# accelerator.context_parallel.algorithm: how attention runs when cp_size > 1.
#   gather_sequence: every cp rank gathers the block's input and computes the whole
#     sequence's attention (exact; attention work and activations not split);
#   allgather_kv: each rank keeps its tokens; K and V are all-gathered over cp;
#   ulysses: all-to-all between sequence and heads around the attention function.
CP_ALGORITHMS = ("gather_sequence", "allgather_kv", "ulysses")
DEFAULT_CP_ALGORITHM = "gather_sequence"


class ContextParallelError(ValueError, HyperParallelError):
    """Context parallel settings that are not valid; names the key or the record."""


@dataclass(frozen=True)
class ContextParallel:
    algorithm: str = DEFAULT_CP_ALGORITHM
    load_balance: bool = False

    def __post_init__(self) -> None:
        if self.algorithm not in CP_ALGORITHMS:
            raise ContextParallelError(f"accelerator.context_parallel.algorithm: expected one of {', '.join(CP_ALGORITHMS)}, "
                             f"got {self.algorithm!r}")

    @classmethod
    def effective(cls, algorithm: str, load_balance: bool, cp: int) -> "ContextParallel":
        """The settings as they act at ``cp`` ranks (see the module docstring)."""
        if cp <= 1:
            return cls()
        return cls(algorithm, bool(load_balance) and algorithm == "allgather_kv")

    @property
    def splits_attention(self) -> bool:
        """Each cp rank keeps only its own tokens through the attention block."""
        return self.algorithm in ("allgather_kv", "ulysses")

    def as_json(self) -> dict:
        return {"algorithm": self.algorithm, "load_balance": self.load_balance}

    @classmethod
    def from_json(cls, data, where: str = "context_parallel") -> "ContextParallel":
        if not isinstance(data, dict) or set(data) != {"algorithm", "load_balance"} or not isinstance(
                data["load_balance"], bool):
            raise ContextParallelError(f"{where}: expected {{'algorithm': str, 'load_balance': bool}}, got {data!r}")
        return cls(data["algorithm"], data["load_balance"])
