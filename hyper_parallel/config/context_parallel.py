"""The context parallel settings as codegen and the planner carry them (torch-free).

``ContextParallel`` is the effective form of the recipe's ``accelerator.context_parallel``
for a layout: with ``cp_size`` 1 there is nothing to split, and only ``allgather_kv``
has a load balance (``gather_sequence`` computes the whole sequence on every rank,
``ulysses`` every head group's whole sequence), so the others normalize to
``load_balance: False``; two recipes that split the same way then sign the same.

A recipe that leaves ``algorithm`` out gets ``DEFAULT_CP_ALGORITHM`` (allgather_kv, which
splits the attention work) *by default* (``by_default``): an attention block that cannot run
it (attention outside transformers' interface, ALiBi, an implementation other than eager or
sdpa, code that fails its dry run on each rank's tokens, ...) then gathers the sequence as ``gather_sequence`` does, and the plan's notes say
which and why. A recipe that names the algorithm gets it or a refusal naming the block.
"""

from dataclasses import dataclass

from hyper_parallel.errors import HyperParallelError

# accelerator.context_parallel.algorithm: how attention runs when cp_size > 1.
#   gather_sequence: every cp rank gathers the block's input and computes the whole
#     sequence's attention (exact; attention work and activations not split);
#   allgather_kv: each rank keeps its tokens; K and V are all-gathered over cp;
#   ulysses: all-to-all between sequence and heads around the attention function.
SPLITTING_ALGORITHMS = ("allgather_kv", "ulysses")
CP_ALGORITHMS = ("gather_sequence", "allgather_kv", "ulysses")
# What a recipe without ``algorithm`` gets (with ``load_balance``, true by default).
DEFAULT_CP_ALGORITHM = "allgather_kv"
# What a layout written without the cp keys means: every bundle made before they existed
# gathered the sequence, and a layout of that algorithm still writes none.
UNWRITTEN_CP_ALGORITHM = "gather_sequence"


class ContextParallelError(ValueError, HyperParallelError):
    """Context parallel settings that are not valid; names the key or the record."""


@dataclass(frozen=True)
class ContextParallel:
    algorithm: str = UNWRITTEN_CP_ALGORITHM
    load_balance: bool = False
    by_default: bool = False  # the recipe left the algorithm out: blocks that cannot split gather

    def __post_init__(self) -> None:
        if self.algorithm not in CP_ALGORITHMS:
            raise ContextParallelError(f"accelerator.context_parallel.algorithm: expected one of {', '.join(CP_ALGORITHMS)}, "
                             f"got {self.algorithm!r}")

    @classmethod
    def effective(cls, algorithm: str, load_balance: bool, cp: int, by_default: bool = False) -> "ContextParallel":
        """The settings as they act at ``cp`` ranks (see the module docstring)."""
        if cp <= 1:
            return cls()
        return cls(algorithm, bool(load_balance) and algorithm == "allgather_kv",
                   bool(by_default) and algorithm in SPLITTING_ALGORITHMS)

    @property
    def splits_attention(self) -> bool:
        """Each cp rank keeps only its own tokens through the attention block."""
        return self.algorithm in SPLITTING_ALGORITHMS
