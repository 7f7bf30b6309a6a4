"""Model entry points for the training path: HyperAutoModel and backend resolution."""

from hyper_parallel.models.hf.auto_model import HyperAutoModel, apply_model_infrastructure
from hyper_parallel.models.hf.backend import (
    BackendError,
    ModelingBackend,
    custom_model_builder,
    resolve_modeling_backend,
)

__all__ = ["BackendError", "HyperAutoModel", "ModelingBackend", "apply_model_infrastructure",
           "custom_model_builder", "resolve_modeling_backend"]
