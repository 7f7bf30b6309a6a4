"""The training recipe as dataclasses.

The recipe YAML is the only input of codegen; these classes mirror its top-level
layout. Field defaults are the values a key takes when the recipe leaves it out.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hyper_parallel.config.context_parallel import (  # noqa: F401 (re-exported)
    CP_ALGORITHMS,
    DEFAULT_CP_ALGORITHM,
    SPLITTING_ALGORITHMS,
)
from hyper_parallel.config.pipeline import DEFAULT_PP_SCHEDULE
from hyper_parallel.config.parallel_dims import ParallelDims
from hyper_parallel.config.plan_override import PlanOverride

DEVICE_TYPES = ("npu", "cuda", "cpu")
# model.init: pretrained loads the folder's weights (and refuses a folder without any);
# random starts from the model's own initialization (training.seed), reading no weights.
MODEL_INITS = ("pretrained", "random")
MODELING_BACKENDS = ("hf", "custom", "gen")
TORCH_DTYPES = ("float32", "bfloat16", "float16", "float64")
# synthetic: random tokens; bytes: a file's bytes modulo the vocabulary (a smoke test);
# text / jsonl / parquet: documents read with HF ``datasets`` and tokenized with the model
# folder's tokenizer (trainer/corpus.py).
DATASET_KINDS = ("synthetic", "bytes", "text", "jsonl", "parquet")
TOKENIZED_KINDS = ("text", "jsonl", "parquet")
TEXT_SAMPLE_BY = ("line", "paragraph", "document")  # what one document of a plain text file is
MAX_SEQ_LEN = 1 << 24  # 16M tokens a sequence: beyond any model's context
# training.mixed_precision's dtypes: the compute (param_dtype) and gradient-reduction dtypes.
MIXED_PRECISION_DTYPES = ("float32", "bfloat16", "float16")
LR_DECAYS = ("constant", "linear", "cosine")  # training.lr_schedule.decay after the warmup


@dataclass
class ModelConfig:
    pretrained_model_name_or_path: str
    init: str = "pretrained"  # one of MODEL_INITS
    config_overrides: dict[str, Any] = field(default_factory=dict)
    torch_dtype: str = "float32"
    attn_implementation: str = "eager"
    force_hf: bool = False
    codegen_artifact_dir: str | None = None
    # The model folder's own code (config.json auto_map) runs only when this is true.
    trust_remote_code: bool = False
    # Packages besides hyper_parallel whose code a replace_module._target_ may name.
    trusted_modules: list[str] = field(default_factory=list)


@dataclass
class ContextParallelConfig:
    """``accelerator.context_parallel``: how attention is split when ``cp_size > 1``.
    ``algorithm`` left out (None): ``DEFAULT_CP_ALGORITHM`` where each attention block can
    run it, the sequence gathered where one cannot (config/context_parallel.py).
    ``load_balance``: (allgather_kv) the sequence is cut into 2*cp chunks and rank r
    holds chunks r and 2*cp-1-r, so every rank has the same causal-attention work."""

    algorithm: str | None = None
    load_balance: bool = True


@dataclass
class PipelineConfig:
    """``accelerator.pipeline`` (``pp_size > 1``): the schedule (config/pipeline.py's
    ``PP_SCHEDULES``) and, optionally, ``split_points``: the first decoder layer of each
    stage after the first (default: stages balanced by parameter count); ``virtual_stages``
    per rank for the interleaved schedule. The number of
    micro-batches is the recipe's (``global_batch_size / (dp_size * micro_batch_size)``)."""

    schedule: str = DEFAULT_PP_SCHEDULE
    split_points: list[int] | None = None
    virtual_stages: int = 1  # stages per rank; 2 or more with schedule interleaved_1f1b


@dataclass
class AcceleratorConfig:
    device_type: str = "cpu"
    dp_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    pp_size: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    nproc_per_node: int = 1
    nnodes: int = 1
    # verify's and preflight's collectives give up after this long; the error names the
    # rank that went silent.
    check_timeout_s: int = 120

    @property
    def parallel_dims(self) -> ParallelDims:
        """The parallel sizes, validated (``ParallelDimsError`` names the bad key)."""
        return ParallelDims(dp=self.dp_size, cp=self.cp_size, tp=self.tp_size, ep=self.ep_size, pp=self.pp_size)

    @property
    def world_size(self) -> int:
        return self.parallel_dims.world_size

    @property
    def layout(self) -> "Layout":
        """The section as one ``Layout`` value (config/layout.py): every size, sp, loss
        parallel and the context-parallel setting as it acts at this cp size."""
        from hyper_parallel.config.layout import Layout  # layout → context_parallel → this module

        return Layout.of(self)


@dataclass
class CheckpointConfig:
    """``training.checkpoint``: where and how often the trainer saves (DCP), and whether a
    restarted run resumes from the latest complete checkpoint."""

    # The checkpoints' folder (one ``step_<N>/`` per checkpoint), relative to the recipe's
    # folder; null: the trainer saves nothing and resumes from nothing.
    dir: str | None = None
    every_steps: int = 100  # save after every this many steps (and after the last step)
    keep_last: int = 3  # complete checkpoints kept, newest first; 0 keeps all
    async_: bool = False  # YAML key ``async``: save in the background (dcp.async_save), training goes on
    resume: bool = True  # a run resumes from the dir's latest complete checkpoint

    # Recipe keys that are not Python names.
    YAML_NAMES: ClassVar[dict[str, str]] = {"async_": "async"}


@dataclass
class MixedPrecisionConfig:
    """``training.mixed_precision``: master parameters and optimizer state stay float32;
    forward and backward compute in ``param_dtype`` (None: ``model.torch_dtype``, the
    dtype the weights are loaded in); gradients are reduced across ranks in
    ``reduce_dtype``. The recipe value ``none`` trains in ``model.torch_dtype`` throughout
    (pure low precision, an explicit opt-in)."""

    param_dtype: str | None = None
    reduce_dtype: str = "float32"


@dataclass
class LrScheduleConfig:
    """``training.lr_schedule``: ``optimizer.lr`` ramps up linearly over ``warmup_steps``,
    then ``decay`` takes it to ``min_lr_ratio * lr`` at ``training.steps``."""

    warmup_steps: int = 0
    decay: str = "constant"  # one of LR_DECAYS
    min_lr_ratio: float = 0.0


@dataclass
class EvalConfig:
    """``training.eval``: every ``every_steps`` steps, the mean loss of ``batches`` held-out
    global batches (no gradients) is recorded as the step's ``eval_loss``."""

    every_steps: int = 100
    batches: int = 1


@dataclass
class MetricsConfig:
    """``training.metrics``: what the run reports besides the ``--metrics`` file."""

    # A TensorBoard log folder (relative to the recipe's folder); null: none written.
    tensorboard_dir: str | None = None
    # The accelerator's peak FLOP/s per rank, for MFU; null: MFU is not reported.
    peak_flops_per_s: float | None = None


@dataclass
class TrainingConfig:
    steps: int = 10
    global_batch_size: int = 8
    micro_batch_size: int = 1
    seq_len: int = 128
    seed: int = 0
    log_every: int = 1
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile each decoder layer (models/hf/compile.py), after the plan, before FSDP2
    max_grad_norm: float | None = None  # clip the global gradient norm to this; None: no clipping
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # A mapping (MixedPrecisionConfig), or the string "none".
    mixed_precision: MixedPrecisionConfig | str = field(default_factory=MixedPrecisionConfig)
    lr_schedule: LrScheduleConfig = field(default_factory=LrScheduleConfig)
    eval: EvalConfig | None = None  # null: no evaluation
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 1.0e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])


@dataclass
class DatasetConfig:
    """``dataset``: where the training tokens come from (trainer/data.py, trainer/corpus.py)."""

    kind: str = "synthetic"  # one of DATASET_KINDS
    # A local file, relative to the recipe's folder; for text, jsonl and parquet also a
    # folder (its files with that format's extensions, in name order).
    path: str | None = None
    text_column: str = "text"  # jsonl and parquet: the field holding each document's text
    sample_by: str = "line"  # text: one document per line, per paragraph (blank lines) or per file
    shuffle: bool = True  # tokenized kinds: the packed sequences in a seeded order, new each epoch
    # tokenized kinds: where the packed rows are cached (trainer/token_cache.py), relative to
    # the recipe's folder; None: the workspace's tokens/ folder
    cache_dir: str | None = None
    # tokenized kinds: processes that tokenize a missing cache entry (0: one per core, up to
    # 16, for data of 64 MB and more; below that, or 1, the preparing rank tokenizes itself)
    tokenize_workers: int = 0
    # tokenized kinds: read, tokenize and pack the rows as training consumes them (no token
    # cache; for corpora that do not fit on disk twice); in order, so shuffle defaults to false
    streaming: bool = False


@dataclass
class TrainerConfig:
    model: ModelConfig
    accelerator: AcceleratorConfig = field(default_factory=AcceleratorConfig)
    # Parsed and checked once, by the loader (config/plan_override.py); read-only after.
    plan_overrides: tuple[PlanOverride, ...] = ()
    codegen: bool = False
    modeling_backend: str | None = None
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    # Absolute path of the YAML this config was read from; set by load_training_config.
    _yaml_path: str | None = field(default=None, repr=False, compare=False)
    # The dotted keys the YAML wrote (``accelerator.context_parallel.algorithm``, ...): a
    # key written where it has no effect is refused, a default left out is not.
    _written_keys: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    @property
    def where(self) -> str:
        """How messages name this recipe: its YAML's path, or ``<recipe>`` for one built in code."""
        return self._yaml_path or "<recipe>"

    @property
    def folder(self) -> Path:
        """Where the recipe's relative paths start: its YAML's folder (the working folder
        for a recipe built in code)."""
        return Path(self._yaml_path).parent if self._yaml_path else Path.cwd()
