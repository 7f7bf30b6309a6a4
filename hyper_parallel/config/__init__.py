"""Recipe (training YAML) loading and validation."""

from hyper_parallel.config.loading import RecipeError, load_training_config
from hyper_parallel.config.schema import TrainerConfig

__all__ = ["RecipeError", "TrainerConfig", "load_training_config"]
