"""BaseTrainer: recipe → mesh → model (through HyperAutoModel) → optimizer → steps.

Launched under torchrun (``python -m hyper_parallel.trainer --config X.yaml``) it
trains the recipe's ``training`` section on synthetic tokens, a file's bytes, or local text,
JSON lines or parquet documents tokenized and packed (trainer/corpus.py), and logs loss and
tokens/s per step; with ``training.checkpoint`` it saves checkpoints and a
restarted run resumes from the newest complete one (trainer/checkpoint.py)."""

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hyper_parallel.config.launch import check_launch_world_size
from hyper_parallel.config.schema import TOKENIZED_KINDS, TrainerConfig
from hyper_parallel.distributed.grad_norm import clip_grads_to
from hyper_parallel.distributed.mesh import MeshContext, build_device_mesh
from hyper_parallel.distributed.optimizer import build_adamw
from hyper_parallel.distributed.pipeline import TiedEmbeddingGradients, tied_embeddings
from hyper_parallel.distributed.step_seed import seed_step
from hyper_parallel.models.hf.auto_model import HyperAutoModel
from hyper_parallel.runtime.compile import compiled_modules
from hyper_parallel.models.hf.model_builder import recipe_model_dir, run_device
from hyper_parallel.platform.device import REDUCE_DTYPE
from hyper_parallel.platform.host_values import to_host_float
from hyper_parallel.runtime.train_step import TrainStep
from hyper_parallel.trainer.checkpoint import Checkpointer, CheckpointError, Resumed
from hyper_parallel.trainer.corpus import (
    PackedCorpus,
    check_vocabulary,
    corpus_batch,
    prepare_corpus_on_every_node,
)
from hyper_parallel.trainer.data import global_batch, micro_batches, read_byte_tokens
from hyper_parallel.trainer.evaluation import due, eval_batches, eval_loss, hold_out
from hyper_parallel.trainer.observe import StepObserver
from hyper_parallel.trainer.summary import closing_lines, startup_lines
from hyper_parallel.trainer.precision import compute_context
from hyper_parallel.trainer.schedule import set_learning_rate

_LOG = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """What rank 0 records of one step (the ``--metrics`` file's lines)."""

    step: int
    loss: float
    grad_norm: float
    tokens_per_s: float
    seconds: float
    lr: float  # the learning rate this step's update used
    eval_loss: float | None = None  # training.eval's held-out loss, on the steps it runs
    mfu: float | None = None  # model FLOPs utilisation against training.metrics.peak_flops_per_s
    peak_memory_bytes: list[int] | None = None  # each rank's peak memory so far, in rank order
    eta_s: float | None = None  # seconds left at this step's pace


class BaseTrainer:
    def __init__(self, config: TrainerConfig, resume: bool = True, metrics_path: str | None = None):
        """``resume``: False starts from the model's weights even when
        ``training.checkpoint.dir`` holds a checkpoint (``--no-resume``). ``metrics_path``:
        rank 0 streams one JSON line per step there (trainer/metrics.py)."""
        self.config = config
        self.metrics_path = metrics_path
        self.resume = resume and config.training.checkpoint.resume
        check_launch_world_size(config)
        acc = config.accelerator
        self.dims = acc.parallel_dims
        self.device = run_device(config)  # every tensor of a step is made here (platform/device.py)
        self.mesh_context = MeshContext(build_device_mesh(self.dims, self.device.type), acc.layout)
        self.rank = dist.get_rank()
        # Before any model is built: a bad dataset is found by every rank alike and said
        # once (trainer/__main__.py); the process group lets the ranks leave together.
        self.corpus = self._prepare_corpus()
        torch.manual_seed(config.training.seed)
        self.model = self._build_model()
        self.pipeline = self._build_pipeline() if self.dims.pp > 1 else None
        self.tied = None  # the embeddings a pipeline split across its first and last stage
        if self.pipeline is not None and tied_embeddings(self.model):
            self.tied = TiedEmbeddingGradients(self.model, self.mesh_context.device_mesh,
                                               config.accelerator.layout.pipeline)
        self.optimizer = self._build_optimizer()
        self.train_step = TrainStep(self.model, self.optimizer, mesh=self.mesh_context.device_mesh, dp=self.dims.dp,
                                    pp=self.dims.pp, pipeline=self.pipeline, tied=self.tied, device=self.device.device,
                                    context=lambda: compute_context(config, fsdp_casts=self.dims.dp > 1))
        self.checkpointer = Checkpointer(config, self.model, self.optimizer, config.where)

    def _prepare_corpus(self) -> PackedCorpus | None:
        """The tokenized, packed dataset for kinds text, jsonl and parquet, memory-mapped from
        the token cache (each node's local rank 0 fills a missing entry; rank 0 logs the
        progress); None for the other kinds."""
        self.eval_rows = None
        if self.config.dataset.kind not in TOKENIZED_KINDS:
            return None
        corpus = prepare_corpus_on_every_node(self.config.dataset, self.config.training,
                                              recipe_model_dir(self.config), self.config.where, log=self.rank == 0)
        corpus, self.eval_rows = hold_out(corpus, self.config)  # training.eval's rows, never trained on
        if self.eval_rows is not None and self.rank == 0:
            _LOG.info(f"training.eval: {self.eval_rows.shape[0]} of {self.eval_rows.shape[0] + corpus.num_rows} "
                      f"packed rows, drawn at random (the same for every run on these data), are held out for "
                      f"evaluation")
        return corpus

    def _data_start(self, resumed: Resumed | None, first: int) -> int:
        """The corpus row the first step of this run starts at: 0, or the position the
        resumed checkpoint recorded, which must be for these very data (same packed rows)."""
        if resumed is None or self.corpus is None:
            return 0
        data = resumed.data
        if data.get("kind") != self.config.dataset.kind or "next_row" not in data:
            if self.rank == 0:
                _LOG.warning(f"checkpoint {resumed.path} recorded no position in a {self.config.dataset.kind} "
                             f"dataset (dataset.kind {data.get('kind')!r}); the dataset starts at step "
                             f"{first}'s rows as if it had been read from the start")
            return first * self.config.training.global_batch_size
        dataset, where = self.config.dataset, self.config.where
        was_streamed = str(data.get("fingerprint", "")).startswith("stream:")
        if was_streamed != dataset.streaming:
            raise CheckpointError(
                f"{where}: dataset.streaming: checkpoint {resumed.path} was trained with dataset.streaming: "
                f"{str(was_streamed).lower()}, this run has {str(dataset.streaming).lower()}; a resumed run keeps the "
                f"one it started with (the two identify their data differently); fix: set dataset.streaming: "
                f"{str(was_streamed).lower()}, or point training.checkpoint.dir elsewhere")
        if "shuffle" in data and bool(data["shuffle"]) != dataset.shuffle:
            raise CheckpointError(
                f"{where}: dataset.shuffle: checkpoint {resumed.path} was trained with shuffle: "
                f"{str(bool(data['shuffle'])).lower()}, this run has {str(dataset.shuffle).lower()}: the rows after "
                f"its data position would be others; fix: set dataset.shuffle: {str(bool(data['shuffle'])).lower()}, "
                f"or point training.checkpoint.dir elsewhere")
        if data.get("fingerprint") != self.corpus.fingerprint:
            raise CheckpointError(
                f"{self.config.where}: dataset.path: the data differ from those checkpoint "
                f"{resumed.path} was trained on (packed sequences sha256 {str(data.get('fingerprint'))[:12]}..., now "
                f"{self.corpus.fingerprint[:12]}...: another file, tokenizer or seq_len), so the run would not "
                f"continue where it stopped; fix: restore the dataset, or point training.checkpoint.dir elsewhere")
        return int(data["next_row"])

    def _build_model(self) -> torch.nn.Module:
        """The recipe's model through HyperAutoModel (the recipe itself knows no models),
        with the backend the recipe resolves to."""
        model = HyperAutoModel.from_pretrained(self.config, mesh_context=self.mesh_context)
        if self.config.training.compile and self.rank == 0:
            compiled = compiled_modules(model)
            _LOG.info(f"training.compile: {len(compiled)} module(s) compiled with torch.compile "
                      f"({', '.join(compiled[:2])}{', ...' if len(compiled) > 2 else ''}); the first step "
                      "includes their compilation")
        return model

    def _build_pipeline(self):
        """torch's schedule over this rank's pipeline stage (distributed/pipeline.py), one
        micro-batch per ``training.micro_batch_size`` rows of the rank's share."""
        from hyper_parallel.distributed.pipeline import build_schedule

        from hyper_parallel.distributed.pipeline import STAGE_ATTRIBUTE

        training = self.config.training
        model = self.model

        pipeline = self.config.accelerator.pipeline
        microbatches = training.global_batch_size // (self.dims.dp * training.micro_batch_size)
        if self.rank == 0:
            info = model.__dict__[STAGE_ATTRIBUTE]
            _LOG.info(f"pipeline: {info.num_stages} stages over pp {self.dims.pp} ({pipeline.schedule}, {microbatches} "
                      f"micro-batches per step); decoder layers by stage: "
                      f"{' '.join(f'[{a}, {b})' for a, b in info.boundaries)}")
        return build_schedule(model, schedule=pipeline.schedule, microbatches=microbatches,
                              pp_group=self.mesh_context.device_mesh.get_group("pp"),
                              device=self.device.device)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW (optimizer.name is checked at recipe load) over the master parameters, stepped
        on their local shards (distributed/optimizer.py; verify steps the same one)."""
        opt = self.config.optimizer
        return build_adamw(self.model.parameters(), lr=opt.lr, betas=tuple(opt.betas), weight_decay=opt.weight_decay)

    def _dp_coordinates(self) -> tuple[int, int]:
        mesh = self.mesh_context.device_mesh
        if self.dims.dp == 1:
            return 0, 1
        return mesh.get_local_rank("dp"), self.dims.dp

    def train(self) -> list[StepRecord]:
        training, dataset = self.config.training, self.config.dataset
        vocab = self.model.config.vocab_size
        where = self.config.where
        byte_tokens = None
        if dataset.kind == "bytes":
            byte_tokens = read_byte_tokens(dataset, vocab, training.global_batch_size * training.seq_len, where)
        if self.corpus is not None:
            check_vocabulary(self.corpus, vocab, recipe_model_dir(self.config), where)
        dp_rank, dp_size = self._dp_coordinates()
        records = []
        self.model.train()
        resumed = self.checkpointer.resume(self.resume)
        first = resumed.step if resumed else 0
        start_row = self._data_start(resumed, first)
        if self.corpus is not None:
            self.checkpointer.data_state = lambda done: self._data_state(start_row + (done - first) *
                                                                         training.global_batch_size)
        self.observer = StepObserver(model=self.model, config=self.config, rank=self.rank, world=self.dims.world_size,
                                     device=self.device,
                                     first_step=first, metrics_path=self.metrics_path)
        evaluation = eval_batches(self.config, vocab, self.eval_rows) if training.eval is not None else []
        if self.rank == 0:
            for line in startup_lines(self.config, self.model, self.device.device, self.corpus, self.metrics_path,
                                      first):
                _LOG.info(line)
        if resumed and self.rank == 0:
            _LOG.info(f"steps {first + 1}..{training.steps} follow" if first < training.steps
                      else f"nothing to train: the checkpoint is at step {first}, training.steps is {training.steps}")
        started = time.perf_counter()
        for step in range(first, training.steps):
            start = time.perf_counter()
            if self.corpus is not None:
                row = start_row + (step - first) * training.global_batch_size
                batch = corpus_batch(self.corpus, row, training, dataset.shuffle)
            else:
                batch = global_batch(step, training, dataset, vocab, byte_tokens)
            seed_step(step, training.seed)
            batch = batch.to(self.device.device, non_blocking=True)
            parts = list(micro_batches(batch, dp_rank, dp_size, training.micro_batch_size, where))
            total = self.train_step.forward_backward(parts)
            grad_norm = self.train_step.grad_norm()
            if training.max_grad_norm is not None:
                clip_grads_to(self.model.parameters(), grad_norm, training.max_grad_norm)
            lr = self._optimizer_step(step + 1)
            total = self.train_step.mean_over_dp(total)
            seconds = time.perf_counter() - start
            record = StepRecord(step + 1, to_host_float(total), grad_norm, batch.numel() / seconds, seconds, lr)
            if due(record.step, self.config):
                record.eval_loss = self._eval_loss(evaluation, dp_rank, dp_size)
            records.append(record)
            self._observe(record)
            self.checkpointer.maybe_save(record.step, last=record.step == training.steps)
        self.checkpointer.finish()
        self.observer.close()
        if self.rank == 0:
            for line in closing_lines(records, self.config, started, self.metrics_path):
                _LOG.info(line)
        return records

    def _optimizer_step(self, update: int) -> float:
        """Update ``update`` (1-based) from the accumulated gradients, which it then clears,
        at training.lr_schedule's rate for it (trainer/schedule.py); the rate used."""
        lr = set_learning_rate(self.optimizer, self.config.optimizer.lr, update, self.config.training)
        self.train_step.update()
        return float(lr)

    def _eval_loss(self, batches: list[torch.Tensor], dp_rank: int, dp_size: int) -> float:
        """training.eval's loss on its held-out batches (trainer/evaluation.py; through the
        schedule's forward-only ``eval`` under pipeline parallel)."""
        group = self.mesh_context.device_mesh.get_group("dp") if dp_size > 1 else None
        if self.pipeline is not None:
            self.model.eval()
            total = torch.zeros((), dtype=REDUCE_DTYPE, device=self.device.device)
            for batch in batches:
                batch = batch.to(self.device.device, non_blocking=True)
                rows = torch.cat(list(micro_batches(batch, dp_rank, dp_size, self.config.training.micro_batch_size,
                                                    "training.eval")))
                total += self.train_step.through_pipeline(rows, self.pipeline.eval)
            self.model.train()
            if dp_size > 1:
                dist.all_reduce(total, group=group)
                total /= dp_size
            return float(total.item()) / len(batches)
        return eval_loss(self.model, batches, dp_rank=dp_rank, dp_size=dp_size,
                         micro_batch_size=self.config.training.micro_batch_size, dp_group=group, device=self.device.device,
                         compute=lambda: compute_context(self.config, fsdp_casts=self.dims.dp > 1))

    def _observe(self, record: StepRecord) -> None:
        """The step reported: its MFU, memory and ETA filled in, the metrics line written,
        the progress line printed (trainer/observe.py). Every rank calls it."""
        self.observer.observe(record)

    def _data_state(self, next_row: int) -> dict:
        """What a checkpoint records of the corpus: the next row and which rows these are."""
        return {"next_row": next_row, "rows": self.corpus.num_rows, "fingerprint": self.corpus.fingerprint,
                "shuffle": self.config.dataset.shuffle}

