"""Which modeling code builds the model: HF's, the project's custom one, or a codegen bundle.

Resolution, first rule that applies wins:

| rule                                  | backend | warning                                   |
|---------------------------------------|---------|-------------------------------------------|
| ``model.force_hf: true``              | hf      | if gen was asked for: bundle not used     |
| ``modeling_backend: hf|custom|gen``   | as set  | custom without a builder: falls back to hf|
| ``codegen: true``                     | gen     |                                           |
| a custom builder for the model type   | custom  |                                           |
| otherwise                             | hf      |                                           |
"""

import importlib
from collections.abc import Callable
from enum import Enum
from types import ModuleType

from hyper_parallel.errors import HyperParallelError


class ModelingBackend(str, Enum):
    HF = "hf"
    CUSTOM = "custom"
    GEN = "gen"


class BackendError(ValueError, HyperParallelError):
    """A modeling backend that cannot be used the way it was asked for."""


# model_type -> the module of its custom backend. Such a module provides
# ``build_custom_model(hf_config, *, device=None)`` and
# ``parallelize_custom_model(model, mesh, *, loss_parallel, enable_sp)``; its model's classes
# declare ``checkpoint_conversion`` (HF names → theirs), which places the HF checkpoint.
# Imported on first use, so registering a model costs nothing until it is built.
CUSTOM_MODEL_MODULES: dict[str, str] = {
    "qwen3_moe": "hyper_parallel.models.qwen3_moe.custom_model",
}
CUSTOM_BUILDER_NAME = "build_custom_model"


def custom_model_module(model_type: str | None) -> ModuleType | None:
    """The custom-backend module for ``model_type``, or None if the project has none
    (not registered, or its module not written yet)."""
    module_name = CUSTOM_MODEL_MODULES.get(model_type or "")
    if module_name is None:
        return None
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only "this module does not exist"; a module that exists but fails to import is a bug to surface.
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            return None
        raise


def custom_model_builder(model_type: str | None) -> Callable | None:
    """The custom-backend builder ``fn(hf_config, *, device=None)`` for ``model_type``, or None."""
    module = custom_model_module(model_type)
    return getattr(module, CUSTOM_BUILDER_NAME, None) if module is not None else None


def resolve_modeling_backend(*, force_hf: bool, modeling_backend: str | ModelingBackend | None,
                             codegen: bool, model_type: str | None) -> tuple[ModelingBackend, list[str]]:
    """The backend to build with, and the warnings to show the user (not yet emitted)."""
    requested = _parse(modeling_backend)
    if force_hf:
        warnings = []
        if requested is ModelingBackend.GEN or (requested is None and codegen):
            warnings.append("model.force_hf is true: building with HF modeling code; the generated modeling "
                            "file (codegen: true / modeling_backend: gen) is not used")
        elif requested is ModelingBackend.CUSTOM:
            warnings.append("model.force_hf is true: building with HF modeling code; "
                            "modeling_backend: custom is ignored")
        return ModelingBackend.HF, warnings
    if requested is None:
        if codegen:
            return ModelingBackend.GEN, []
        if custom_model_builder(model_type) is not None:
            return ModelingBackend.CUSTOM, []
        return ModelingBackend.HF, []
    if requested is ModelingBackend.CUSTOM and custom_model_builder(model_type) is None:
        return ModelingBackend.HF, [f"modeling_backend: custom, but there is no custom model for model_type "
                                    f"{model_type!r} (registered: {sorted(CUSTOM_MODEL_MODULES)}); "
                                    f"falling back to HF modeling code"]
    return requested, []


def _parse(value: str | ModelingBackend | None) -> ModelingBackend | None:
    if value is None or isinstance(value, ModelingBackend):
        return value
    try:
        return ModelingBackend(value)
    except ValueError:
        raise BackendError(f"modeling_backend: expected one of {[b.value for b in ModelingBackend]}, "
                           f"got {value!r}") from None
