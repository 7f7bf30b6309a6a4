"""Pipeline parallel settings and the stage split, torch-free.

``accelerator.pipeline`` (with ``pp_size > 1``): the schedule torch's pipelining engine
runs (``PP_SCHEDULES``) and, optionally, where the stages start (``split_points``: the
first decoder layer of stages 1..pp-1). Without split points the decoder layers are cut
into contiguous stages that balance their parameter counts (``balanced_split``), which
for a model of equal layers is a split by layer count; the embeddings go with the first
stage, the final norm, head and loss with the last. One function (``stage_split``)
decides the split, for codegen's plan record and for the runtime alike.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from hyper_parallel.errors import HyperParallelError

# accelerator.pipeline.schedule: torch.distributed.pipelining's schedules.
#   gpipe: every micro-batch's forward, then every backward (most activation memory);
#   1f1b: one forward, one backward in steady state (activations of at most pp micro-batches);
#   interleaved_1f1b: 1F1B over virtual_stages >= 2 stages per rank (stage s on rank s % pp),
#     a smaller bubble for more point-to-point traffic.
#   interleaved_zero_bubble: interleaved_1f1b with each backward split into the input's gradient
#     (on the critical path) and the weights' (filling the bubble);
#   zbv, dualpipev: two stages per rank in a V (rank r runs stages r and 2*pp-1-r), zero-bubble.
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")  # two stages per rank, in a V
ZERO_BUBBLE_SCHEDULES = ("interleaved_zero_bubble", "zbv", "dualpipev")  # backward split: inputs', weights' gradients
DEFAULT_PP_SCHEDULE = "1f1b"


class PipelineError(ValueError, HyperParallelError):
    """Pipeline settings or a split that cannot be; names the recipe key."""


@dataclass(frozen=True)
class PipelineSettings:
    schedule: str = DEFAULT_PP_SCHEDULE
    split_points: tuple[int, ...] | None = None  # first layer of every stage but the first; None: balanced
    virtual_stages: int = 1  # stages per rank

    def __post_init__(self) -> None:
        if self.schedule not in PP_SCHEDULES:
            raise PipelineError(f"accelerator.pipeline.schedule: expected one of {', '.join(PP_SCHEDULES)}, "
                                f"got {self.schedule!r}")
        virtual = self.virtual_stages
        if not isinstance(virtual, int) or isinstance(virtual, bool) or virtual < 1:
            raise PipelineError(f"accelerator.pipeline.virtual_stages: expected an integer >= 1, got {virtual!r}")
        if (self.schedule in MULTI_STAGE_SCHEDULES) != (virtual > 1):
            raise PipelineError(
                f"accelerator.pipeline.virtual_stages: {self.schedule} runs "
                f"{'two or more stages' if self.schedule in MULTI_STAGE_SCHEDULES else 'one stage'} per rank, got "
                f"{virtual}; use schedule {MULTI_STAGE_SCHEDULES[0]} with virtual_stages >= 2, or "
                f"{' / '.join(s for s in PP_SCHEDULES if s not in MULTI_STAGE_SCHEDULES)} with virtual_stages 1")
        if self.schedule in V_SCHEDULES and virtual != 2:
            raise PipelineError(f"accelerator.pipeline.virtual_stages: {self.schedule} runs two stages per rank in a "
                                f"V (rank r runs stages r and 2 x pp_size - 1 - r), got {virtual}; set "
                                f"virtual_stages: 2")
        points = self.split_points
        if points is not None:
            if not all(isinstance(p, int) and not isinstance(p, bool) and p >= 1 for p in points) or \
                    list(points) != sorted(set(points)):
                raise PipelineError(f"accelerator.pipeline.split_points: expected increasing layer indices >= 1 "
                                    f"(the first layer of each stage after the first), got {list(points)}")
            object.__setattr__(self, "split_points", tuple(points))

    def stages(self, pp: int) -> int:
        """The number of pipeline stages over ``pp`` ranks."""
        return pp * self.virtual_stages

    def stages_of_rank(self, rank: int, pp: int) -> tuple[int, ...]:
        """The stages pp rank ``rank`` runs: stage s lives on rank s % pp (the loop order
        torch's interleaved schedules expect), or for a V schedule stages r and
        2 * pp - 1 - r (the first and the last on rank 0)."""
        if self.schedule in V_SCHEDULES:
            return (rank, 2 * pp - 1 - rank)
        return tuple(rank + round_ * pp for round_ in range(self.virtual_stages))

    def rank_of_stage(self, stage: int, pp: int) -> int:
        """The pp rank that runs ``stage`` (``stages_of_rank`` read the other way)."""
        return next(rank for rank in range(pp) if stage in self.stages_of_rank(rank, pp))


def stage_split(settings: PipelineSettings, pp: int, layer_weights: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``[start, end)`` decoder layer ranges, one per stage (``pp`` ranks times the virtual
    stages), covering every layer once in order, each non-empty: from the split points
    when the recipe gives them, else balanced by ``layer_weights`` (a parameter count per
    layer)."""
    layers, stages = len(layer_weights), settings.stages(pp)
    if stages > layers:
        what = f"pp_size {pp} x virtual_stages {settings.virtual_stages} = " if settings.virtual_stages > 1 else ""
        raise PipelineError(f"accelerator.pp_size: {what}{stages} stages need at least {stages} decoder layers, "
                            f"the model has {layers}; use fewer stages")
    points = settings.split_points
    if points is None:
        return balanced_split(layer_weights, stages)
    if len(points) != stages - 1 or points[-1] >= layers:
        raise PipelineError(f"accelerator.pipeline.split_points: expected {stages - 1} increasing layer indices "
                            f"in 1..{layers - 1} ({stages} stages, {layers} decoder layers), got {list(points)}")
    bounds = (0, *points, layers)
    return tuple(zip(bounds[:-1], bounds[1:]))


def balanced_split(weights: Sequence[int], stages: int) -> tuple[tuple[int, int], ...]:
    """Contiguous, non-empty ranges of ``weights`` whose largest sum is the least any
    split into ``stages`` ranges has (the classic linear partition, by dynamic
    programming); ties go to the split whose earlier stages end first."""
    count = len(weights)
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + max(int(weight), 1))
    # best[s][i]: the least largest sum splitting the first i layers into s ranges.
    best = [[float("inf")] * (count + 1) for _ in range(stages + 1)]
    cut = [[0] * (count + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, count + 1):
            for j in range(s - 1, i):
                largest = max(best[s - 1][j], prefix[i] - prefix[j])
                if largest < best[s][i]:
                    best[s][i], cut[s][i] = largest, j
    ranges, end = [], count
    for s in range(stages, 0, -1):
        start = cut[s][end]
        ranges.append((start, end))
        end = start
    return tuple(reversed(ranges))
