"""One training step of a parallelized model, as the trainer runs it and verify proves it.

A step is: forward and backward of this rank's micro-batches (gradients accumulated, each
loss divided by their number) or of the pipeline schedule over them; the loss averaged over
the data-parallel ranks; the global gradient norm (distributed/grad_norm.py, every rank's
shards counted once, tied pipeline embeddings once); the update (the run's AdamW stepping
local shards, distributed/optimizer.py) and the gradients cleared. The trainer
(trainer/base.py) adds what a run has around it (batches, the lr schedule, clipping, eval,
metrics, checkpoints); verify (codegen/check/verify_worker.py) reads every gradient between
the backward and the update. Both call these methods on the same kind of object, so a
change to the step is a change to what verify proves.
"""

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from hyper_parallel.distributed.grad_norm import global_grad_norm


class TrainStep:
    """The step of ``model`` (this rank's part of it) with ``optimizer``.

    ``pipeline``: torch's schedule over this rank's stages (distributed/pipeline.py), or
    None; ``tied``: the embeddings a pipeline split across its end stages
    (``TiedEmbeddingGradients``), or None; ``mesh``: the device mesh (its ``pp`` and ``dp``
    groups); ``dp``/``pp``: their sizes; ``context``: the context forward and backward run
    in (mixed precision's autocast, trainer/precision.py); ``device``: the run device."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, mesh, dp: int, pp: int,
                 pipeline=None, tied=None, context: Callable[[], contextlib.AbstractContextManager] = None,
                 device: torch.device | None = None) -> None:
        self.model, self.optimizer, self.mesh = model, optimizer, mesh
        self.dp, self.pp = dp, pp
        self.pipeline, self.tied = pipeline, tied
        self.context = context or contextlib.nullcontext
        self.device = device

    def forward_backward(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Forward and backward of one step's micro-batches, gradients accumulated; the
        step's mean loss on this rank (a plain tensor, detached)."""
        if self.pipeline is not None:
            total = self.through_pipeline(torch.cat(parts), self.pipeline.step, return_outputs=False)
            if self.tied is not None:
                self.tied.sum()
            return total
        total = None
        for micro in parts:
            with self.context():
                loss = self.model(input_ids=micro, labels=micro).loss / len(parts)
            loss.backward()
            value = loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
            total = value if total is None else total + value
        return total

    def through_pipeline(self, rows: torch.Tensor, run, **options) -> torch.Tensor:
        """``run`` (the schedule's ``step`` or ``eval``) over ``rows`` in the step's context
        (distributed/pipeline.py's ``through_pipeline``): the mean loss on every stage."""
        from hyper_parallel.distributed.pipeline import through_pipeline

        with self.context():
            return through_pipeline(self.model, run, rows, self.mesh.get_group("pp"), **options)

    def mean_over_dp(self, total: torch.Tensor) -> torch.Tensor:
        """The step's loss averaged over the data-parallel ranks (every rank the same value)."""
        if self.dp > 1:
            dist.all_reduce(total, group=self.mesh.get_group("dp"))
            total = total / self.dp
        return total

    def grad_norm(self) -> float:
        """The global gradient norm over every rank's shards, each counted once."""
        counted = self.tied.counted() if self.tied is not None else self.model.parameters()
        return global_grad_norm(counted, pp=self.pp, device=self.device)

    def update(self) -> None:
        """The optimizer's update from the accumulated gradients, which it then clears."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
