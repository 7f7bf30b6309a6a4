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
    pretrained_model_name_or_path: str  # the model folder (config.json, weights, tokenizer), relative to the recipe
    init: str = "pretrained"  # one of MODEL_INITS: the folder's weights, or the model's own random initialization
    config_overrides: dict[str, Any] = field(default_factory=dict)  # config.json keys replaced for this recipe
    torch_dtype: str = "float32"  # one of TORCH_DTYPES: the weights' dtype and the compute dtype under mixed precision
    attn_implementation: str = "eager"  # transformers' attention: eager, sdpa, flash_attention_2, ...
    force_hf: bool = False  # build with transformers' modeling code even where a bundle or custom model exists
    # The bundle's folder, relative to the recipe; null: generated/ beside the recipe (shared by
    # the recipes of that folder).
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

    algorithm: str | None = None  # one of CP_ALGORITHMS; null: DEFAULT_CP_ALGORITHM where attention can run it
    load_balance: bool = True  # allgather_kv: each rank holds chunks r and 2*cp-1-r of the sequence (equal work)


@dataclass
class PipelineConfig:
    """``accelerator.pipeline`` (``pp_size > 1``): the schedule (config/pipeline.py's
    ``PP_SCHEDULES``) and, optionally, ``split_points``: the first decoder layer of each
    stage after the first (default: stages balanced by parameter count); ``virtual_stages``
    per rank for the interleaved schedule. The number of
    micro-batches is the recipe's (``global_batch_size / (dp_size * micro_batch_size)``)."""

    schedule: str = DEFAULT_PP_SCHEDULE  # torch.distributed.pipelining's schedule (config/pipeline.py PP_SCHEDULES)
    split_points: list[int] | None = None  # the first decoder layer of each stage after the first; null: balanced
    virtual_stages: int = 1  # stages per rank; 2 or more with schedule interleaved_1f1b


@dataclass
class AcceleratorConfig:
    device_type: str = "cpu"  # one of DEVICE_TYPES: the run's device (an absent one is refused at start)
    dp_size: int = 1  # data parallel ranks (FSDP2 shards parameters, gradients and optimizer state over them)
    tp_size: int = 1  # tensor parallel ranks (heads, MLP width, vocabulary split)
    cp_size: int = 1  # context parallel ranks (the sequence split end to end)
    ep_size: int = 1  # expert parallel ranks, borrowed from dp*cp (must divide it): experts split over them
    pp_size: int = 1  # pipeline stages (decoder layers split); world = pp*dp*cp*tp
    sequence_parallel: bool = False  # tp: norms and the residual stream sharded on the sequence between blocks
    loss_parallel: bool = False  # tp: logits stay vocabulary-sharded into the cross entropy
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)  # how cp splits attention
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)  # pp > 1: the schedule and the stage split
    nproc_per_node: int = 1  # processes per node (trainer launch starts them)
    nnodes: int = 1  # nodes; nproc_per_node * nnodes is the world size
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

    param_dtype: str | None = None  # the compute dtype of forward and backward; null: model.torch_dtype
    reduce_dtype: str = "float32"  # the dtype gradients are reduced in across dp ranks


@dataclass
class LrScheduleConfig:
    """``training.lr_schedule``: ``optimizer.lr`` ramps up linearly over ``warmup_steps``,
    then ``decay`` takes it to ``min_lr_ratio * lr`` at ``training.steps``."""

    warmup_steps: int = 0  # updates over which the rate rises linearly from 0 to optimizer.lr
    decay: str = "constant"  # one of LR_DECAYS: the rate's course after the warmup
    min_lr_ratio: float = 0.0  # the rate at the last step, as a fraction of optimizer.lr (linear and cosine)


@dataclass
class EvalConfig:
    """``training.eval``: every ``every_steps`` steps, the mean loss of ``batches`` held-out
    global batches (no gradients) is recorded as the step's ``eval_loss``."""

    every_steps: int = 100  # evaluate after every this many steps, and after the last
    batches: int = 1  # held-out global batches evaluated each time


@dataclass
class MetricsConfig:
    """``training.metrics``: what the run reports besides the ``--metrics`` file."""

    # A TensorBoard log folder (relative to the recipe's folder); null: none written.
    tensorboard_dir: str | None = None
    # The accelerator's peak FLOP/s per rank, for MFU; null: MFU is not reported.
    peak_flops_per_s: float | None = None


@dataclass
class TrainingConfig:
    steps: int = 10  # optimizer updates the run trains
    global_batch_size: int = 8  # sequences per update over all dp ranks
    micro_batch_size: int = 1  # sequences per forward and backward on one rank (gradients accumulate)
    seq_len: int = 128  # tokens per sequence
    seed: int = 0  # the model's initialization, the data's order and each step's random state
    log_every: int = 1  # rank 0 prints a progress line every this many steps (and the last)
    activation_checkpointing: bool = False  # recompute each decoder layer's activations in backward
    compile: bool = False  # torch.compile each decoder layer (runtime/compile.py), after the plan, before FSDP2
    max_grad_norm: float | None = None  # clip the global gradient norm to this; None: no clipping
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # saving and resuming (DCP)
    # A mapping (MixedPrecisionConfig), or the string "none".
    mixed_precision: MixedPrecisionConfig | str = field(default_factory=MixedPrecisionConfig)
    lr_schedule: LrScheduleConfig = field(default_factory=LrScheduleConfig)  # warmup and decay of optimizer.lr
    eval: EvalConfig | None = None  # null: no evaluation
    metrics: MetricsConfig = field(default_factory=MetricsConfig)  # TensorBoard and MFU


@dataclass
class OptimizerConfig:
    name: str = "adamw"  # the optimizer: adamw (torch.optim.AdamW)
    lr: float = 1.0e-4  # the peak learning rate (training.lr_schedule shapes it)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW's betas (0.95, not torch's 0.999)


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
    model: ModelConfig  # the model: its folder, dtype, attention and bundle folder
    accelerator: AcceleratorConfig = field(default_factory=AcceleratorConfig)  # the device and the parallel layout
    # Module entries that change the derived plan or replace modules (the codegen guide's
    # "plan_overrides"); parsed and checked once by the loader (config/plan_override.py).
    plan_overrides: tuple[PlanOverride, ...] = ()
    codegen: bool = False  # train the generated bundle (modeling_backend gen)
    modeling_backend: str | None = None  # one of MODELING_BACKENDS; null: resolved as the training guide's "Starting a run" says
    training: TrainingConfig = field(default_factory=TrainingConfig)  # steps, batch, sequence, checkpoints, eval
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # AdamW's settings
    dataset: DatasetConfig = field(default_factory=DatasetConfig)  # where the training tokens come from
    # Absolute path of the YAML this config was read from; set by load_training_config.
    _yaml_path: str | None = field(default=None, repr=False, compare=False)
    # The dotted keys the YAML wrote (``accelerator.context_parallel.algorithm``, ...): a
    # key written where it has no effect is refused, a default left out is not.
    _written_keys: frozenset[str] = field(default=frozenset(), repr=False, compare=False)
    # The --set KEY=VALUE items it was loaded with (config/loading.py): a process that loads
    # the recipe again for the same run (a preflight rank) applies them too.
    _overrides: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @property
    def where(self) -> str:
        """How messages name this recipe: its YAML's path, or ``<recipe>`` for one built in code."""
        return self._yaml_path or "<recipe>"

    @property
    def folder(self) -> Path:
        """Where the recipe's relative paths start: its YAML's folder (the working folder
        for a recipe built in code)."""
        return Path(self._yaml_path).parent if self._yaml_path else Path.cwd()
