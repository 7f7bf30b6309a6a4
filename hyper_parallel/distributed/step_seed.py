"""One seed per training step, the same on every rank and in the single-process reference."""

import torch


def seed_step(step: int, seed: int) -> None:
    """Seed the global random state for ``step`` of a run seeded ``seed``. A model drawing
    random numbers in training (PhiMoE's router samples its experts) then draws, on every
    tensor-parallel rank, exactly what one process draws for the same tokens (each rank
    runs the whole batch; a layout that splits the tokens cannot, and verify refuses it).
    Seeding per step, not once, keeps a step's draws independent of what ran before it
    (model building, loading, logging)."""
    torch.manual_seed(seed * 1_000_003 + step + 1)
