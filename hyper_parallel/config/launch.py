"""The recipe against the launch it runs under: a check every torchrun entry point makes.

It lives with the recipe, not with codegen, because the trainer, the codegen CLI and the
preflight worker all make it, and the trainer must not reach into codegen for it.
"""

import os

from hyper_parallel.config.loading import RecipeError
from hyper_parallel.config.schema import TrainerConfig


def check_launch_world_size(config: TrainerConfig) -> None:
    """Under torchrun, WORLD_SIZE must be the recipe's world size."""
    launched = os.environ.get("WORLD_SIZE")
    expected = config.accelerator.world_size
    if launched is not None and int(launched) != expected:
        raise RecipeError(
            f"{config._yaml_path}: accelerator: the recipe needs world size dp*cp*tp*pp = {expected}, "
            f"but torchrun started WORLD_SIZE={launched}; launch with --nproc_per_node={expected} "
            f"(times nnodes) or change the recipe")
