"""Preflight (DESIGN §7): per-rank integrity checks and the torchrun launcher."""

import fnmatch
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hyper_parallel.codegen.artifact import META_FILE
from hyper_parallel.codegen.check.drift import bundle_file_problems, fix_command
from hyper_parallel.codegen.hash import sha256_bytes, sha256_file
from hyper_parallel.codegen.meta import MetaError, load_codegen_meta
from hyper_parallel.codegen.spec.types import CodegenSpec


PREFLIGHT_TIMEOUT_S = 900


class PreflightError(RuntimeError):
    """The bundle is not fit to train with; the message says what and how to fix it."""


def preflight_integrity_check(artifact_dir: str | Path, *, expected_signature: str | None = None,
                              model: Any = None, fix: str = "doit generate") -> dict[str, Any]:
    """Checks every rank runs before importing a bundle. Returns a small report."""
    from hyper_parallel.codegen.loader import load_generated_module

    artifact_dir = Path(artifact_dir)
    try:
        meta = load_codegen_meta(artifact_dir)
    except MetaError as exc:
        raise PreflightError(f"{exc}\n  fix: {fix}") from None
    if expected_signature is not None and meta["signature"] != expected_signature:
        raise PreflightError(f"{artifact_dir / META_FILE}: signature mismatch: expected {expected_signature}, "
                             f"bundle has {meta['signature']}\n  fix: {fix}")
    problems = bundle_file_problems(artifact_dir, meta)
    if problems:
        raise PreflightError("\n".join(problems) + f"\n  fix: {fix}")
    module = load_generated_module(artifact_dir)
    plan = getattr(module, "HYPER_PARALLEL_PLAN", None)
    if not plan or not plan.get("modules"):
        raise PreflightError(f"{artifact_dir / meta['modeling_file']}: HYPER_PARALLEL_PLAN is empty\n  fix: {fix}")
    if model is not None:
        uncovered = uncovered_parameters(model, plan["modules"])
        if uncovered:
            raise PreflightError(f"{artifact_dir / meta['modeling_file']}: the frozen plan covers no entry for "
                                 f"parameter(s) {', '.join(uncovered[:5])}\n  fix: {fix}")
    return {"signature": meta["signature"], "digest": bundle_digest(artifact_dir, meta),
            "plan_entries": len(plan["modules"])}


def bundle_digest(artifact_dir: Path, meta: dict[str, Any]) -> str:
    """One hash for everything a rank will import: the meta and every listed file."""
    parts = [sha256_file(artifact_dir / META_FILE)] + [
        f"{name}={sha256_file(artifact_dir / name)}" for name in sorted(meta["outputs"])]
    return sha256_bytes("\n".join(parts).encode())


def plan_entry_for(module_fqn: str, modules: dict[str, Any]) -> tuple[str, dict] | None:
    if module_fqn in modules:
        return module_fqn, modules[module_fqn]
    for key, entry in modules.items():
        if fnmatch.fnmatchcase(module_fqn, key):
            return key, entry
    return None


def uncovered_parameters(model: Any, modules: dict[str, Any]) -> list[str]:
    missing = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        owner, _, leaf = name.rpartition(".")
        found = plan_entry_for(owner, modules)
        if found is None or leaf not in found[1].get("state_shardings", {}):
            missing.append(name)
    return missing


def run_torchrun_preflight(spec: CodegenSpec, log: Callable[[str], None]) -> dict[str, Any]:
    """Run the preflight worker on ``world_size`` ranks with torchrun (gloo on CPU)."""
    world = spec.parallel.world_size
    with tempfile.TemporaryDirectory(prefix="hp-preflight-") as tmp:
        report_path = Path(tmp) / "report.json"
        # --standalone: torchrun picks a free rendezvous port itself (no check-then-use race).
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "-m", "hyper_parallel.codegen.check.preflight_worker",
               "--config", str(spec.recipe_path), "--report", str(report_path)]
        log(f"torchrun --nproc_per_node={world} preflight of {spec.artifact_dir}")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HYPER_PARALLEL_WORKSPACE": str(spec.workspace.parent)}
        env.pop("WORLD_SIZE", None)
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=PREFLIGHT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise PreflightError(f"preflight on {world} ranks for {spec.artifact_dir} did not finish within "
                                 f"{PREFLIGHT_TIMEOUT_S}s (a rank stuck in a collective?)\n"
                                 f"  fix: run `{fix_command(spec)}` again; if it repeats, run the worker by hand:"
                                 f" {' '.join(cmd)}") from None
        report = json.loads(report_path.read_text()) if report_path.is_file() else None
    if proc.returncode != 0 or report is None or not report.get("ok"):
        reason = (report or {}).get("error") or _last_error_line(proc.stderr + proc.stdout)
        fix = "" if "fix:" in reason else f"\n  fix: {fix_command(spec)}"
        raise PreflightError(f"preflight failed on {world} ranks for {spec.artifact_dir}:\n{reason}{fix}")
    log(f"ok on {world} ranks: {report['params_checked']} parameters' local shards match the plan; "
        f"bundle digest {report['digest'][:12]} identical on every rank")
    return report



def _last_error_line(output: str) -> str:
    """The failing rank's own error (``[rankN]: SomeError: ...``) rather than torchrun's
    ChildFailedError summary, which says only that a child failed."""
    lines = [ln for ln in output.splitlines() if ln.strip() and not ln.startswith(("W1", "I1", "*"))]
    errors = [ln for ln in lines if "Error" in ln or "Exception" in ln]
    from_ranks = [ln for ln in errors if ln.startswith("[rank") and "ChildFailedError" not in ln]
    own = [ln for ln in errors if "ChildFailedError" not in ln and "elastic" not in ln]
    return (from_ranks or own or errors or lines or ["(no output)"])[-1]
