"""Drive the stages: the incremental pipeline (CLI, doit) and rank coordination (training).

``run_pipeline`` runs each stale stage in order; ``ensure_codegen_artifact`` is the
training path: rank 0 generates or reuses, the other ranks wait for a bundle whose
signature equals theirs, then every rank runs the integrity preflight.
"""

import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from hyper_parallel.codegen.bundle_folder import (
    check_creatable,
    check_not_anothers_tracked_bundle,
    check_owned,
    remove_stale_staging_dirs,
)
from hyper_parallel.codegen.bundle_share import share_bundle
from hyper_parallel.codegen.spec.project import project_codegen_spec, signature_from_spec
from hyper_parallel.codegen.spec.types import STAGES, CodegenSpec
from hyper_parallel.codegen.stages import run_stage, stage_is_current
from hyper_parallel.codegen.workspace import check_workspace_owned, read_json, remove_orphaned_temp_files, write_json
from hyper_parallel.config import load_training_config
from hyper_parallel.config.schema import TrainerConfig
from hyper_parallel.distributed.ranks import BUNDLE_WAIT_TIMEOUT_S, fake_world, group_of_several_ranks
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.runtime.meta import META_FILE

_LOG = logging.getLogger(__name__)


class CodegenWaitError(TimeoutError, HyperParallelError):
    """A non-zero rank gave up waiting for rank 0's bundle."""


def load_spec(config_path: str | Path, workspace_root: str | Path | None = None) -> CodegenSpec:
    """The recipe at ``config_path`` parsed and projected (doit's tasks, tests)."""
    return project_codegen_spec(load_training_config(config_path), workspace_root=workspace_root)


def run_pipeline(spec: CodegenSpec, stages: Iterable[str] = STAGES, *, force: bool = False) -> list[str]:
    """Run every stale stage in order; return the names of the stages that ran. A run that
    fails in a recipe's first build leaves no workspace behind (nothing on disk changed)."""
    if "install" in stages:  # before any work: a folder install would refuse is refused now
        check_creatable(spec.bundle_dir)
        check_owned(spec.bundle_dir, "install", spec.bundle_file_names)
        check_not_anothers_tracked_bundle(spec.bundle_dir, spec.recipe_rel, f"doit generate config={spec.recipe_path}")
    remove_orphaned_temp_files(spec.workspace)  # what a killed run left: the next run cleans up
    remove_stale_staging_dirs(spec.bundle_dir)
    fresh = not spec.workspace.exists()
    fresh_root = not spec.workspace.parent.exists()
    ran = []
    try:
        for stage in stages:
            if not force and stage_is_current(spec, stage):
                _LOG.info(f"-- {stage} up to date")
                continue
            seconds = run_stage(spec, stage)
            _LOG.info(f". {stage} done in {seconds:.2f}s")
            ran.append(stage)
    except BaseException:
        if fresh and spec.workspace.is_dir() and not spec.workspace.is_symlink():
            shutil.rmtree(spec.workspace, ignore_errors=True)
        if fresh_root and spec.workspace.parent.is_dir() and not any(spec.workspace.parent.iterdir()):
            spec.workspace.parent.rmdir()
        raise
    return ran


def clean_recipe(spec: CodegenSpec, *, what: tuple[str, ...] = ("bundle", "workspace")) -> None:
    """Remove the installed bundle and/or the recipe's workspace (doit and the CLI)."""
    targets = []
    if "bundle" in what and (spec.bundle_dir.is_dir() or spec.bundle_dir.is_symlink()):
        check_owned(spec.bundle_dir, "remove")
        targets.append(spec.bundle_dir)
    if "workspace" in what and (spec.workspace.is_dir() or spec.workspace.is_symlink()):
        check_workspace_owned(spec.workspace)
        targets.append(spec.workspace)
    for target in targets:  # both checked first: a refusal leaves both as they were
        shutil.rmtree(target)
        _LOG.info(f"removed {target}")


def _failure_marker(spec: CodegenSpec) -> Path:
    """Beside the bundle, which every rank must see (the workspace may be node-local)."""
    return spec.bundle_dir.parent / f".{spec.bundle_dir.name}.generation-failed.json"


def _run_id() -> str:
    """torchrun's id for this launch: a failure record from an earlier launch is ignored."""
    return os.environ.get("TORCHELASTIC_RUN_ID", "")


def ensure_codegen_artifact(config: TrainerConfig, *, rank: int | None = None,
                            timeout_s: float = BUNDLE_WAIT_TIMEOUT_S, poll_s: float = 0.2,
                            workspace_root: str | Path | None = None) -> CodegenSpec:
    """Make sure the recipe's bundle is installed and current, coordinating ranks. (The
    name is the seed's, which calls the bundle an "artifact"; so is the recipe key
    ``model.codegen_artifact_dir``. Everywhere else the one word is "bundle".)

    Rank 0 reuses a current bundle as is (no planning at training start) or runs the
    stages through install (the torchrun preflight is not nested inside a training job).
    With a process group of several ranks up, rank 0 then sends the bundle's bytes to
    every rank and each node's local rank 0 installs them where its node's copy is
    missing or stale (``bundle_share.py``: no shared filesystem needed), every rank waiting
    at most ``timeout_s`` seconds. Without one, the other ranks wait as long for a meta
    whose signature equals theirs in the one folder, or for rank 0's failure record of
    this launch."""
    spec = project_codegen_spec(config, workspace_root=workspace_root)
    ensure_bundle(spec, rank=rank, timeout_s=timeout_s, poll_s=poll_s)
    return spec


def ensure_bundle(spec: CodegenSpec, *, rank: int | None = None, timeout_s: float = BUNDLE_WAIT_TIMEOUT_S,
                  poll_s: float = 0.2) -> None:
    """``ensure_codegen_artifact`` for a recipe already projected (the CLI projects it once)."""
    from hyper_parallel.codegen.check.drift import installed_bundle_problems

    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    signature = signature_from_spec(spec)

    def build() -> None:
        if installed_bundle_problems(spec):
            run_pipeline(spec, STAGES[:-1])
        else:
            _LOG.info(f"reusing {spec.bundle_dir} (signature {signature[:12]})")

    if group_of_several_ranks():  # the bytes travel over the process group: no shared folder needed
        share_bundle(spec, signature, build, rank=rank, timeout_s=timeout_s)
        return
    if fake_world():  # a rank alone (trainer dry-run): it builds or reuses for itself, as rank 0 would
        build()
        return
    if rank == 0:
        marker = _failure_marker(spec)
        marker.unlink(missing_ok=True)
        try:
            build()
        except Exception as exc:
            write_json(marker, {"signature": signature, "run_id": _run_id(),
                                "error": f"{type(exc).__name__}: {exc}"})
            raise
    else:
        _wait_for_bundle(spec, signature, timeout_s, poll_s)


def _wait_for_bundle(spec: CodegenSpec, signature: str, timeout_s: float, poll_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    meta_path = spec.bundle_dir / META_FILE
    while True:
        meta = read_json(meta_path)
        if meta and meta.get("signature") == signature:
            return
        failure = read_json(_failure_marker(spec))
        if failure and failure.get("signature") == signature and failure.get("run_id", "") == _run_id():
            raise CodegenWaitError(f"rank 0 failed to generate {spec.bundle_dir}: {failure['error']}")
        if time.monotonic() >= deadline:
            found = meta.get("signature") if meta else "no bundle"
            raise CodegenWaitError(
                f"waited {timeout_s:.0f}s for rank 0 to install {meta_path} with signature {signature} "
                f"(found: {found}); is rank 0 running and the folder shared with this rank?")
        time.sleep(poll_s)
