"""Drive the stages: the incremental pipeline (CLI, doit) and rank coordination (training).

``run_pipeline`` runs each stale stage in order; ``ensure_codegen_artifact`` is the
training path: rank 0 generates or reuses, the other ranks wait for a bundle whose
signature equals theirs, then every rank runs the integrity preflight.
"""

import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from hyper_parallel.codegen.artifact import META_FILE
from hyper_parallel.codegen.spec.project import project_codegen_spec, signature_from_spec
from hyper_parallel.codegen.spec.types import STAGES, CodegenSpec
from hyper_parallel.codegen.stages import read_json, run_stage, stage_is_current, write_json
from hyper_parallel.config import load_training_config
from hyper_parallel.config.schema import TrainerConfig

Log = Callable[[str], None]
GENERATE_STAGES = STAGES  # through the torchrun preflight
DEFAULT_WAIT_TIMEOUT_S = 600.0


class CodegenWaitError(TimeoutError):
    """A non-zero rank gave up waiting for rank 0's bundle."""


def load_spec(config_path: str | Path, workspace_root: str | Path | None = None) -> CodegenSpec:
    return project_codegen_spec(load_training_config(config_path), workspace_root=workspace_root)


def run_pipeline(spec: CodegenSpec, stages: Iterable[str] = GENERATE_STAGES, *, force: bool = False,
                 log: Log = print) -> list[str]:
    """Run every stale stage in order; return the names of the stages that ran."""
    ran = []
    for stage in stages:
        if not force and stage_is_current(spec, stage):
            log(f"-- {stage} up to date")
            continue
        seconds = run_stage(spec, stage, log)
        log(f". {stage} done in {seconds:.2f}s")
        ran.append(stage)
    return ran


def clean_recipe(spec: CodegenSpec, log: Log = print) -> None:
    """Remove the installed bundle and the recipe's workspace."""
    for path in (spec.artifact_dir, spec.workspace):
        if path.is_dir():
            shutil.rmtree(path)
            log(f"removed {path}")


def _failure_marker(spec: CodegenSpec) -> Path:
    return spec.workspace / "generation-failed.json"


def ensure_codegen_artifact(config: TrainerConfig, *, rank: int | None = None,
                            timeout_s: float = DEFAULT_WAIT_TIMEOUT_S, poll_s: float = 0.2,
                            workspace_root: str | Path | None = None, log: Log = print) -> CodegenSpec:
    """Make sure the recipe's bundle is installed and current, coordinating ranks by files.

    Rank 0 runs the stages through install (the torchrun preflight is not nested inside
    a training job). Other ranks wait, at most ``timeout_s`` seconds, for a meta whose
    signature equals theirs, or for rank 0's failure record."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    spec = project_codegen_spec(config, workspace_root=workspace_root)
    signature = signature_from_spec(spec)
    if rank == 0:
        try:
            run_pipeline(spec, STAGES[:-1], log=log)
        except Exception as exc:
            write_json(_failure_marker(spec), {"signature": signature, "error": f"{type(exc).__name__}: {exc}"})
            raise
        _failure_marker(spec).unlink(missing_ok=True)
        return spec
    _wait_for_bundle(spec, signature, timeout_s, poll_s)
    return spec


def _wait_for_bundle(spec: CodegenSpec, signature: str, timeout_s: float, poll_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    meta_path = spec.artifact_dir / META_FILE
    while True:
        meta = read_json(meta_path)
        if meta and meta.get("signature") == signature:
            return
        failure = read_json(_failure_marker(spec))
        if failure and failure.get("signature") == signature:
            raise CodegenWaitError(f"rank 0 failed to generate {spec.artifact_dir}: {failure['error']}")
        if time.monotonic() >= deadline:
            found = meta.get("signature") if meta else "no bundle"
            raise CodegenWaitError(
                f"waited {timeout_s:.0f}s for rank 0 to install {meta_path} with signature {signature} "
                f"(found: {found}); is rank 0 running and the folder shared with this rank?")
        time.sleep(poll_s)
