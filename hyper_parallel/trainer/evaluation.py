"""``training.eval``: the loss on data training never sees, every ``every_steps`` steps.

Tokenized datasets (text, jsonl, parquet) hold out ``batches * global_batch_size`` packed
rows drawn at random, by a generator of fixed seed (``HOLD_OUT_SEED``, not
``training.seed``): every run on the same data holds out the same rows, and they are
spread over the whole corpus (its last rows are the last files of a folder in name
order, a sample of one or two documents, unlike the rest). Training reads the other rows
in their order (its epochs are shorter by that much); evaluation reads the held-out ones
in corpus order. Synthetic data has no split to
make: evaluation batch j is the batch of step ``-1 - j``, a seed no training step uses.
A file's bytes (kind bytes, a smoke test) has no evaluation. The loss is the mean over
the batches of the step's loss without gradients, averaged over dp like the training loss,
so every rank and the single-process reference compute the same number."""

import dataclasses
import hashlib

import torch
import torch.distributed as dist

from hyper_parallel.config.schema import TrainerConfig
from hyper_parallel.platform.device import REDUCE_DTYPE
from hyper_parallel.trainer.corpus import PackedCorpus
from hyper_parallel.trainer.data import DataError, global_batch, micro_batches

HOLD_OUT_SEED = 0


def hold_out(corpus: PackedCorpus, config: TrainerConfig) -> tuple[PackedCorpus, torch.Tensor | None]:
    """The rows training reads and the rows evaluation reads (None without ``training.eval``).
    The training part's fingerprint names the split, so a checkpoint resumes only onto the
    same training rows."""
    evaluation = config.training.eval
    if evaluation is None:
        return corpus, None
    held = evaluation.batches * config.training.global_batch_size
    if held >= corpus.num_rows:
        raise DataError(f"{config.where}: training.eval.batches: {evaluation.batches} batches of "
                        f"{config.training.global_batch_size} rows hold out {held} packed rows, but the dataset has "
                        f"{corpus.num_rows}; use fewer eval batches or more data")
    chosen = torch.zeros(corpus.num_rows, dtype=torch.bool)
    chosen[torch.randperm(corpus.num_rows, generator=torch.Generator().manual_seed(HOLD_OUT_SEED))[:held]] = True
    fingerprint = hashlib.sha256(f"{corpus.fingerprint}:eval_rows={held}:random{HOLD_OUT_SEED}".encode()).hexdigest()
    # the training rows by their numbers: a memory-mapped corpus is not read, let alone copied
    train = dataclasses.replace(corpus, fingerprint=fingerprint, ids=torch.nonzero(~chosen).flatten())
    return train, corpus.take(torch.nonzero(chosen).flatten())


def eval_batches(config: TrainerConfig, vocab_size: int, held_rows: torch.Tensor | None) -> list[torch.Tensor]:
    """The evaluation's global batches, the same for every rank and every evaluation."""
    training = config.training
    count = training.eval.batches
    if held_rows is not None:
        return list(held_rows.split(training.global_batch_size))
    return [global_batch(-1 - j, training, config.dataset, vocab_size) for j in range(count)]


def due(step: int, config: TrainerConfig) -> bool:
    """Whether step ``step`` (1-based) ends with an evaluation: every ``every_steps`` and the last."""
    evaluation = config.training.eval
    return evaluation is not None and (step % evaluation.every_steps == 0 or step == config.training.steps)


def eval_loss(model, batches: list[torch.Tensor], *, dp_rank: int, dp_size: int, micro_batch_size: int,
              compute, dp_group=None, device: torch.device | str = "cpu") -> float:
    """Mean loss over ``batches`` without gradients; ``compute`` is the step's precision
    context, ``device`` the run's (the batches go there, the sum stays there until its one
    read). The model is put back in training mode."""
    model.eval()
    total = torch.zeros((), dtype=REDUCE_DTYPE, device=device)
    with torch.no_grad():
        for batch in batches:
            batch = batch.to(device, non_blocking=True)
            parts = list(micro_batches(batch, dp_rank, dp_size, micro_batch_size, "training.eval"))
            for micro in parts:
                with compute():
                    loss = model(input_ids=micro, labels=micro).loss
                value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
                total += value.float() / len(parts)
    model.train()
    if dp_size > 1:
        dist.all_reduce(total, group=dp_group)
        total /= dp_size
    return float(total.item()) / len(batches)
