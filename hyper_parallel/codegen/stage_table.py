"""The pipeline's stage table as data: the one list of stages.

``stages`` (the library functions), ``doit_tasks`` (the doit task creators) and
``dodo.py`` (through ``doit_tasks``) derive everything they say about a stage from
this table: its order, what it reads, what it writes, which code it runs and its help
text. Import-light on purpose: doit's ``list``, ``clean`` and every up-to-date check
import it, so it imports nothing heavy (the standard library and the bundle's
meta file name).
"""

from dataclasses import dataclass

from hyper_parallel.config.workspace import WORKSPACE_DIR, WORKSPACE_ENV  # noqa: F401 (re-exported)
from hyper_parallel.runtime.meta import META_FILE

# The pipeline workspace: per-recipe stage outputs and doit's state (config/workspace.py).
STAGED_DIR = "staged"  # the staged bundle, inside a recipe's workspace
SIGNATURES_FILE = "signatures.json"  # stage -> the signature its record was built from
REPLACED_FILE = "replaced_bundle.json"  # the bundle install replaced, until preflight passes (replaced_bundle.py)
IN_BUNDLE = "<bundle>"  # an output written into the installed bundle, not into the workspace
RECORD, INSTALLED = "record", "installed"  # how a stage's output is judged current (Stage.current)
_STAGES_MODULE = "hyper_parallel.codegen.stages"


@dataclass(frozen=True)
class Stage:
    """One row of the stage table.

    ``facts``: the recipe facts (named in ``spec.project.SPEC_FACTS``) its output depends
    on; ``reads``: the earlier stages whose outputs it reads; ``output``: its record, a
    file in the recipe's workspace, or ``<bundle>/<file>`` for one in the installed
    bundle; ``doc``: what it does, for ``doit list``; ``runner``: the function that runs it
    (``module:function``, imported when the stage runs, so the table stays import-light);
    its implementation hash covers what the runner imports (``codegen/hash.runner_parts``)
    and ``dynamic``, the parts of the package it runs by computed names that no import
    statement shows (a recipe's ``replace_module`` targets); ``current``: how its record is
    judged current — ``RECORD`` (its signature in the workspace and the staged files it
    lists) or ``INSTALLED`` (the bundle installed with this recipe's signature)."""

    name: str
    doc: str
    facts: tuple[str, ...]
    reads: tuple[str, ...]
    output: str
    runner: str
    current: str
    dynamic: tuple[str, ...] = ()

    @property
    def in_bundle(self) -> bool:
        """Whether the output lives in the installed bundle (else in the workspace)."""
        return self.output.startswith(IN_BUNDLE + "/")

    @property
    def output_name(self) -> str:
        """The output's file name, relative to its folder (workspace or bundle)."""
        return self.output.rpartition("/")[2] if self.in_bundle else self.output


STAGE_TABLE: tuple[Stage, ...] = (
    Stage("resolve", "find the HF modeling source, its sha256 and the transformers version",
          facts=("source", "model_dir", "config_sha256"), reads=(), output="source.json",
          runner=f"{_STAGES_MODULE}:run_resolve", current=RECORD),
    Stage("derive", "plan every module on a meta-device model over an offline mesh",
          facts=("parallel", "plan_overrides", "config_overrides"), reads=("resolve",), output="plan.json",
          dynamic=("models", "components"),
          runner=f"{_STAGES_MODULE}:run_derive", current=RECORD),
    Stage("freeze", "validate, normalize and pattern-compress the plan",
          facts=(), reads=("derive",), output="frozen.json",
          runner=f"{_STAGES_MODULE}:run_freeze", current=RECORD),
    Stage("emit", "write the generated modeling file and __init__.py (staged)",
          facts=("bundle_signature", "modeling_file"), reads=("freeze", "resolve"), output="emit.json",
          runner=f"{_STAGES_MODULE}:run_emit", current=RECORD),
    Stage("diff", "diff the generated file against the HF modeling source (staged)",
          facts=("modeling_file",), reads=("emit", "resolve"), output="diff.json",
          runner=f"{_STAGES_MODULE}:run_diff", current=RECORD),
    Stage("verify", "run the staged bundle at the recipe's world size on a shrunk probe; compare loss and "
                    "gradients with one process",
          facts=("parallel", "attn_implementation"), reads=("emit",), output="verify.json",
          dynamic=("models", "components"),
          runner=f"{_STAGES_MODULE}:run_verify", current=RECORD),
    # install's record is the bundle's meta, sealed with the bundle signature itself
    Stage("install", "swap the verified staged bundle into <recipe dir>/generated/ atomically",
          facts=("bundle_signature",), reads=("emit", "diff", "verify"), output=f"{IN_BUNDLE}/{META_FILE}",
          runner=f"{_STAGES_MODULE}:run_install", current=INSTALLED),
    Stage("preflight", "torchrun across the recipe's world size: apply the plan, check shards and digests",
          facts=("world_size",), reads=("install",), output="preflight.json",
          dynamic=("models", "components"),
          runner=f"{_STAGES_MODULE}:run_preflight", current=RECORD),
)

STAGES: tuple[str, ...] = tuple(stage.name for stage in STAGE_TABLE)
STAGE_BY_NAME: dict[str, Stage] = {stage.name: stage for stage in STAGE_TABLE}
# Every entry a recipe's workspace may hold: the stage records, their signatures and the staged bundle.
WORKSPACE_ENTRIES: frozenset[str] = frozenset(
    {stage.output_name for stage in STAGE_TABLE if not stage.in_bundle} | {STAGED_DIR, SIGNATURES_FILE, REPLACED_FILE})


def stage_row(name: str) -> Stage:
    """The row of stage ``name``; a name the table lacks is a programming error, named."""
    try:
        return STAGE_BY_NAME[name]
    except KeyError:
        raise KeyError(f"no stage {name!r} in the stage table (stages: {', '.join(STAGES)})") from None


def is_read_by_a_later_stage(name: str) -> bool:
    """Whether another stage reads this one's output (doit needs it declared as a target)."""
    return any(name in other.reads for other in STAGE_TABLE)


def check_table(table: tuple[Stage, ...]) -> None:
    """Each stage reads only earlier stages, so the table's order is a run order; checked
    at import, so a wrong edit of the table fails at once, naming the row."""
    names = [row.name for row in table]
    for index, row in enumerate(table):
        unknown = [r for r in row.reads if r not in names[:index]]
        if unknown:
            raise ValueError(f"stage table: {row.name} reads {unknown}, not an earlier stage")
        if row.current not in (RECORD, INSTALLED) or row.runner.count(":") != 1:
            raise ValueError(f"stage table: {row.name}: current must be {RECORD!r} or {INSTALLED!r} and runner "
                             f"'module:function', got {row.current!r} and {row.runner!r}")


check_table(STAGE_TABLE)
