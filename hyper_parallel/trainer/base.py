"""BaseTrainer: recipe → mesh → model (through HyperAutoModel) → optimizer → steps.

Launched under torchrun (``python -m hyper_parallel.trainer --config X.yaml``) it
trains the recipe's ``training`` section on synthetic tokens or a local text file and
logs loss and tokens/s per step; with ``training.checkpoint`` it saves checkpoints and a
restarted run resumes from the newest complete one (trainer/checkpoint.py)."""

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hyper_parallel.config.launch import check_launch_world_size
from hyper_parallel.config.schema import TrainerConfig
from hyper_parallel.distributed.grad_norm import clip_grads_to, global_grad_norm
from hyper_parallel.distributed.mesh import MeshContext, build_device_mesh
from hyper_parallel.models.hf.auto_model import HyperAutoModel
from hyper_parallel.models.hf.model_builder import runtime_device_type
from hyper_parallel.trainer.checkpoint import Checkpointer
from hyper_parallel.trainer.data import global_batch, micro_batches, read_text_tokens, seed_step

_LOG = logging.getLogger(__name__)


@dataclass
class StepRecord:
    step: int
    loss: float
    grad_norm: float
    tokens_per_s: float
    seconds: float


class BaseTrainer:
    def __init__(self, config: TrainerConfig, resume: bool = True):
        """``resume``: False starts from the model's weights even when
        ``training.checkpoint.dir`` holds a checkpoint (``--no-resume``)."""
        self.config = config
        self.resume = resume and config.training.checkpoint.resume
        check_launch_world_size(config)
        acc = config.accelerator
        self.dims = acc.parallel_dims
        self.mesh_context = MeshContext(build_device_mesh(self.dims, runtime_device_type(acc.device_type)), self.dims)
        self.rank = dist.get_rank()
        torch.manual_seed(config.training.seed)
        self.model = self._build_model()
        self.optimizer = self._build_optimizer()
        self.checkpointer = Checkpointer(config, self.model, self.optimizer, config._yaml_path or "<recipe>")

    def _build_model(self) -> torch.nn.Module:
        """The recipe's model through HyperAutoModel (seed §10's ``config.model.build(...)``,
        which the recipe no longer carries: the recipe knows no models), with the backend
        the recipe resolves to."""
        return HyperAutoModel.from_pretrained(self.config, mesh_context=self.mesh_context)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        opt = self.config.optimizer
        if opt.name.lower() != "adamw":
            raise ValueError(f"{self.config._yaml_path}: optimizer.name: expected 'adamw', got {opt.name!r}")
        return torch.optim.AdamW(self.model.parameters(), lr=opt.lr, betas=tuple(opt.betas),
                                 weight_decay=opt.weight_decay, foreach=False)

    def _dp_coordinates(self) -> tuple[int, int]:
        mesh = self.mesh_context.device_mesh
        if self.dims.dp == 1:
            return 0, 1
        return mesh.get_local_rank("dp"), self.dims.dp

    def train(self) -> list[StepRecord]:
        training, dataset = self.config.training, self.config.dataset
        vocab = self.model.config.vocab_size
        where = self.config._yaml_path or "<recipe>"
        text = None
        if dataset.kind == "text":
            text = read_text_tokens(dataset, vocab, training.global_batch_size * training.seq_len, where)
        dp_rank, dp_size = self._dp_coordinates()
        records = []
        self.model.train()
        resumed = self.checkpointer.resume(self.resume)
        first = resumed.step if resumed else 0
        if resumed and self.rank == 0:
            _LOG.info(f"steps {first + 1}..{training.steps} follow" if first < training.steps
                      else f"nothing to train: the checkpoint is at step {first}, training.steps is {training.steps}")
        for step in range(first, training.steps):
            start = time.perf_counter()
            batch = global_batch(step, training, dataset, vocab, text)
            seed_step(step, training)
            parts = list(micro_batches(batch, dp_rank, dp_size, training.micro_batch_size, where))
            total = None
            for micro in parts:
                loss = self.model(input_ids=micro, labels=micro).loss / len(parts)
                loss.backward()
                value = loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
                total = value if total is None else total + value
            grad_norm = global_grad_norm(self.model.parameters())
            if training.max_grad_norm is not None:
                clip_grads_to(self.model.parameters(), grad_norm, training.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if dp_size > 1:
                dist.all_reduce(total, group=self.mesh_context.device_mesh.get_group("dp"))
                total /= dp_size
            seconds = time.perf_counter() - start
            record = StepRecord(step + 1, total.item(), grad_norm, batch.numel() / seconds, seconds)
            records.append(record)
            if self.rank == 0 and (record.step % training.log_every == 0 or record.step == training.steps):
                _LOG.info(f"step {record.step}/{training.steps} | loss {record.loss:.6f} | "
                          f"grad norm {record.grad_norm:.4f} | "
                          f"{record.tokens_per_s:,.0f} tok/s | {seconds:.2f}s")
            self.checkpointer.maybe_save(record.step, last=record.step == training.steps)
        self.checkpointer.finish()
        return records


def write_metrics(records: list[StepRecord], path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps([r.__dict__ for r in records], indent=1) + "\n")
