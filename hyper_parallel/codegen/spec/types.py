"""CodegenSpec: the part of a recipe that can change a generated bundle."""

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from hyper_parallel.codegen.source.resolver import ModelSource, SourceLocation, hash_source
from hyper_parallel.codegen.stage_table import STAGES
from hyper_parallel.config.context_parallel import ContextParallel
from hyper_parallel.config.parallel_dims import ParallelDims
from hyper_parallel.config.plan_override import PlanOverride, replacement_entries
from hyper_parallel.protocols.axes import SIZE_AXES

__all__ = ["STAGES", "CodegenSpec", "ParallelSpec"]  # STAGES: the stage table's, re-exported


@dataclass(frozen=True)
class ParallelSpec:
    """The recipe's layout: its one ``ParallelDims`` and the options that go with it."""

    dims: ParallelDims
    sequence_parallel: bool
    loss_parallel: bool
    device_type: str
    context_parallel: ContextParallel = ContextParallel()  # effective for this cp size

    dp = property(lambda self: self.dims.dp)
    cp = property(lambda self: self.dims.cp)
    tp = property(lambda self: self.dims.tp)
    ep = property(lambda self: self.dims.ep)
    pp = property(lambda self: self.dims.pp)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    def as_dict(self) -> dict[str, Any]:
        """The layout as signatures, the meta and the banner write it; the context parallel
        keys only where cp splits attention another way than gather_sequence (the method
        every bundle had before the keys existed, which therefore signs as it did)."""
        cp_keys = {"cp_algorithm": self.context_parallel.algorithm,
                   "cp_load_balance": self.context_parallel.load_balance} if self.cp > 1 and (
            self.context_parallel.algorithm != "gather_sequence") else {}
        return {**{axis: getattr(self, axis) for axis in SIZE_AXES},
                "sequence_parallel": self.sequence_parallel, "loss_parallel": self.loss_parallel, **cp_keys,
                "device_type": self.device_type, "world_size": self.world_size}


@dataclass(frozen=True)
class CodegenSpec:
    """Everything codegen needs from a recipe. Absolute paths are for I/O only;
    signatures use the ``*_rel`` fields, so moving the checkout keeps bundles valid."""

    recipe_path: Path
    recipe_rel: str  # the recipe as seen from the bundle directory, e.g. "../qwen3_moe.yaml"
    model_dir: Path
    model_dir_rel: str  # relative to the recipe's folder
    model_config: dict[str, Any] = field(repr=False, hash=False, compare=False)
    model_config_sha256: str = ""
    config_overrides: dict[str, Any] = field(default_factory=dict, hash=False)
    torch_dtype: str = "float32"
    attn_implementation: str = "eager"
    location: SourceLocation | None = None  # where the model source is; ``source`` is it resolved
    parallel: ParallelSpec | None = None
    plan_overrides: tuple[PlanOverride, ...] = ()  # as the loader parsed and checked them
    bundle_dir: Path = Path()
    bundle_dir_rel: str = "generated"
    modeling_file: str = ""
    workspace: Path = Path()
    recipe_id: str = ""
    check_timeout_s: int = 120  # collectives of verify and preflight (not a codegen input)

    @cached_property
    def source(self) -> ModelSource:
        """The model source resolved: its bytes hashed on first use, which is the resolve
        stage's (its up-to-date check or its run), never the projection's; then fixed for
        this spec's life, so one run judges and builds every stage from one source."""
        return hash_source(self.location)

    @property
    def replacements(self) -> list[dict[str, Any]]:
        """The ``replace_module`` entries in the runtime's form (``hyper_apply_replacements``)."""
        return replacement_entries(self.plan_overrides)

    @property
    def plan_overrides_json(self) -> list[dict[str, Any]]:
        """The entries as the signatures hash them."""
        return [entry.as_json() for entry in self.plan_overrides]

    @property
    def diff_file(self) -> str:
        return self.modeling_file + ".diff"

    @property
    def bundle_file_names(self) -> tuple[str, ...]:
        """Every file an install of this recipe writes besides codegen_meta.json."""
        return (self.modeling_file, "__init__.py", self.diff_file, *self.location.sibling_names)
