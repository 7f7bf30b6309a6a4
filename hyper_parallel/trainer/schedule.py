"""``training.lr_schedule``: the learning rate of each update as a function of its step.

Update n (1-based) uses ``optimizer.lr * lr_multiplier(n)``: a linear warmup over the first
``warmup_steps`` updates (lr/warmup, 2 lr/warmup, ..., lr), then ``decay`` from lr down to
``min_lr_ratio * lr`` at the last step (``training.steps``): constant (no decay), linear,
or cosine (half a cosine wave). A function of the step alone, like torchtitan's warmup +
decay LambdaLR: the trainer sets each update's rate before AdamW's step, so a resumed run
recomputes it from the checkpoint's step (no scheduler state to save or restore) and its
updates stay bitwise those of an uninterrupted run."""

import math

from hyper_parallel.config.schema import TrainingConfig


def lr_multiplier(update: int, training: TrainingConfig) -> float:
    """The factor on ``optimizer.lr`` for update ``update`` (1 for the first)."""
    schedule = training.lr_schedule
    warmup = schedule.warmup_steps
    if warmup and update <= warmup:
        return update / warmup
    if schedule.decay == "constant":
        return 1.0
    progress = (update - warmup) / max(1, training.steps - warmup)  # (0, 1]: 1 at the last step
    floor = schedule.min_lr_ratio
    if schedule.decay == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine


def set_learning_rate(optimizer, base_lr: float, update: int, training: TrainingConfig) -> float:
    """Every parameter group's rate for update ``update``; the rate set."""
    lr = base_lr * lr_multiplier(update, training)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
