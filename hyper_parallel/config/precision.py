"""``training.mixed_precision`` resolved into three dtypes: the one that
holds parameters, gradients and AdamW's state; the one forward and backward compute in;
the one gradients are reduced in across data-parallel ranks. One function decides them,
so the model builder, FSDP2, the trainer's autocast and the single-process reference agree."""

from dataclasses import dataclass

from hyper_parallel.config.schema import TrainerConfig


@dataclass(frozen=True)
class PrecisionPolicy:
    """dtype names (``"float32"``, ``"bfloat16"``, ...) of one run."""

    master: str  # parameters, gradients, optimizer state
    compute: str  # forward and backward
    reduce: str  # gradient reduction over dp

    @property
    def mixed(self) -> bool:
        """Whether compute differs from the stored parameters (autocast or FSDP2 casts)."""
        return self.compute != self.master or self.reduce != self.master


def precision_policy(config: TrainerConfig) -> PrecisionPolicy:
    """Mixed precision (the default): float32 master parameters (float64 when the weights
    load as float64), compute in ``param_dtype`` (default ``model.torch_dtype``), reduce in
    ``reduce_dtype``. ``mixed_precision: none``: everything in ``model.torch_dtype``."""
    loaded = config.model.torch_dtype
    setting = config.training.mixed_precision
    if isinstance(setting, str):  # "none", checked at load
        return PrecisionPolicy(loaded, loaded, loaded)
    master = "float64" if loaded == "float64" else "float32"
    return PrecisionPolicy(master, setting.param_dtype or loaded, setting.reduce_dtype)
