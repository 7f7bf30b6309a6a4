"""CodegenSpec: the part of a recipe that can change a generated bundle."""

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from hyper_parallel.codegen.source.resolver import ModelSource, SourceLocation, hash_source
from hyper_parallel.codegen.stage_table import STAGES
from hyper_parallel.config.layout import Layout
from hyper_parallel.config.plan_override import PlanOverride, replacement_entries

__all__ = ["STAGES", "CodegenSpec"]  # STAGES: the stage table's, re-exported


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
    layout: Layout = Layout()  # the recipe's accelerator section as one value
    device_type: str = "cpu"
    plan_overrides: tuple[PlanOverride, ...] = ()  # as the loader parsed and checked them
    bundle_dir: Path = Path()
    bundle_dir_rel: str = "generated"
    modeling_file: str = ""
    workspace: Path = Path()
    recipe_id: str = ""
    check_timeout_s: int = 120  # collectives of verify and preflight (not a codegen input)
    recipe_overrides: tuple[str, ...] = ()  # the --set items the recipe was loaded with (preflight's ranks too)

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

    def parallel_record(self) -> dict[str, Any]:
        """The layout as signatures, the meta and the banner write it, with the device type
        and the world size."""
        return {**self.layout.as_dict(), "device_type": self.device_type, "world_size": self.layout.world_size}

    @property
    def diff_file(self) -> str:
        return self.modeling_file + ".diff"

    @property
    def bundle_file_names(self) -> tuple[str, ...]:
        """Every file an install of this recipe writes besides codegen_meta.json."""
        return (self.modeling_file, "__init__.py", self.diff_file, *self.location.sibling_names)
