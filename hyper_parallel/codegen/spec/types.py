"""CodegenSpec: the part of a recipe that can change a generated bundle."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyper_parallel.codegen.source.resolver import ModelSource
from hyper_parallel.config.parallel_dims import ParallelDims

STAGES = ("resolve", "derive", "freeze", "emit", "diff", "verify", "install", "preflight")

# Which parts of the package each stage's output depends on (relative to hyper_parallel/).
# A change to one of these files reruns that stage; nothing else does.
STAGE_IMPLEMENTATION = {
    "resolve": ("codegen/source", "codegen/spec", "codegen/hash.py"),
    "derive": ("codegen/plan", "codegen/runtime.py", "codegen/check/probe.py", "class_paths.py", "distributed",
               "protocols", "models", "components"),  # probe.py: the dataflow trace's tiny copy
    "freeze": ("codegen/plan/freeze.py", "protocols/placement_text.py"),
    "emit": ("codegen/emit", "codegen/astkit", "codegen/meta.py", "codegen/stages.py"),
    "diff": ("codegen/emit/diff.py",),
    "verify": ("codegen/check", "codegen/loader.py", "codegen/runtime.py", "codegen/plan/derive.py", "class_paths.py",
               "distributed", "protocols", "models", "components"),
    "install": ("codegen/artifact.py", "codegen/meta.py"),
    "preflight": ("codegen/check", "codegen/loader.py", "codegen/runtime.py", "class_paths.py", "distributed"),
}
BUNDLE_IMPLEMENTATION = tuple(sorted({p for parts in STAGE_IMPLEMENTATION.values() for p in parts}))


@dataclass(frozen=True)
class ParallelSpec:
    """The recipe's layout: its one ``ParallelDims`` and the options that go with it."""

    dims: ParallelDims
    sequence_parallel: bool
    loss_parallel: bool
    device_type: str

    dp = property(lambda self: self.dims.dp)
    cp = property(lambda self: self.dims.cp)
    tp = property(lambda self: self.dims.tp)
    ep = property(lambda self: self.dims.ep)
    pp = property(lambda self: self.dims.pp)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    def as_dict(self) -> dict[str, Any]:
        return {"dp": self.dp, "cp": self.cp, "tp": self.tp, "ep": self.ep, "pp": self.pp,
                "sequence_parallel": self.sequence_parallel, "loss_parallel": self.loss_parallel,
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
    source: ModelSource | None = None
    parallel: ParallelSpec | None = None
    plan_overrides: tuple[dict[str, Any], ...] = ()
    artifact_dir: Path = Path()
    artifact_dir_rel: str = "generated"
    modeling_file: str = ""
    workspace: Path = Path()
    recipe_id: str = ""
    check_timeout_s: int = 120  # collectives of verify and preflight (not a codegen input)

    @property
    def replacements(self) -> list[dict[str, Any]]:
        """The ``replace_module`` entries, in the form the emitter and runtime take."""
        return [
            {"match": o["match"], "module_type": o["module_type"], "exact_type": o["exact_type"],
             "target": o["replace_module"]["target"], "kwargs": o["replace_module"]["kwargs"],
             "origin": f"plan_overrides[{i}].replace_module._target_"}
            for i, o in enumerate(self.plan_overrides) if o.get("replace_module")
        ]

    @property
    def diff_file(self) -> str:
        return self.modeling_file + ".diff"

    @property
    def bundle_file_names(self) -> tuple[str, ...]:
        """Every file an install of this recipe writes besides codegen_meta.json."""
        return (self.modeling_file, "__init__.py", self.diff_file, *(name for name, _ in self.source.siblings))
