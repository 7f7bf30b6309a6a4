"""Preflight: per-rank integrity checks and the torchrun launcher."""

import json
import logging
import os
from pathlib import Path
from typing import Any

from hyper_parallel.codegen.bundle_folder import META_FILE
from hyper_parallel.codegen.check.forked_torchrun import rank_preload, torchrun_command
from hyper_parallel.codegen.check.launch import LaunchError, RankFiles, RankLaunch, scratch_dir, wait_for_ranks
from hyper_parallel.codegen.check.drift import bundle_file_problems, fix_command
from hyper_parallel.codegen.hash import sha256_bytes, sha256_file
from hyper_parallel.codegen.meta import MetaError, load_codegen_meta
from hyper_parallel.codegen.spec.types import CodegenSpec
from hyper_parallel.distributed.plan_format import plan_entries
from hyper_parallel.errors import HyperParallelError

_LOG = logging.getLogger(__name__)

PREFLIGHT_TIMEOUT_S = 900


class PreflightError(RuntimeError, HyperParallelError):
    """The bundle is not fit to train with; the message says what and how to fix it."""


def preflight_integrity_check(bundle_dir: str | Path, *, expected_signature: str | None = None,
                              model: Any = None, fix: str = "doit generate") -> dict[str, Any]:
    """Checks every rank runs before importing a bundle. Returns a small report."""
    from hyper_parallel.codegen.loader import load_generated_module

    bundle_dir = Path(bundle_dir)
    try:
        meta = load_codegen_meta(bundle_dir)
    except MetaError as exc:
        raise PreflightError(f"{exc}\n  fix: {fix}") from None
    if expected_signature is not None and meta["signature"] != expected_signature:
        raise PreflightError(f"{bundle_dir / META_FILE}: signature mismatch: expected {expected_signature}, "
                             f"bundle has {meta['signature']}\n  fix: {fix}")
    problems = bundle_file_problems(bundle_dir, meta)
    if problems:
        raise PreflightError("\n".join(problems) + f"\n  fix: {fix}")
    module = load_generated_module(bundle_dir)
    plan = getattr(module, "HYPER_PARALLEL_PLAN", None)
    if not plan or not plan.get("modules"):
        raise PreflightError(f"{bundle_dir / meta['modeling_file']}: HYPER_PARALLEL_PLAN is empty\n  fix: {fix}")
    if model is not None:
        uncovered = uncovered_parameters(model, plan_entries(plan))
        if uncovered:
            raise PreflightError(f"{bundle_dir / meta['modeling_file']}: the frozen plan covers no entry for "
                                 f"parameter(s) {', '.join(uncovered[:5])}\n  fix: {fix}")
    return {"signature": meta["signature"], "digest": bundle_digest(bundle_dir, meta),
            "plan_entries": len(plan["modules"])}


def bundle_digest(bundle_dir: Path, meta: dict[str, Any]) -> str:
    """One hash for everything a rank will import: the meta and every listed file."""
    parts = [sha256_file(bundle_dir / META_FILE)] + [
        f"{name}={sha256_file(bundle_dir / name)}" for name in sorted(meta["outputs"])]
    return sha256_bytes("\n".join(parts).encode())


def uncovered_parameters(model: Any, modules: dict[str, dict]) -> list[str]:
    """Trainable parameters no entry of ``modules`` (full entries, ``plan_entries``) places."""
    from hyper_parallel.distributed.name_match import plan_entry_for

    missing = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        owner, _, leaf = name.rpartition(".")
        found = plan_entry_for(owner, modules)
        if found is None or leaf not in found[1].get("state_shardings", {}):
            missing.append(name)
    return missing


def run_torchrun_preflight(spec: CodegenSpec) -> dict[str, Any]:
    """Run the preflight worker on ``world_size`` ranks with torchrun (gloo on CPU); above
    verify's process cap, in this one process (``preflight_in_process``). Each rank reports
    on its own; the bundle digests are compared here, so a silent rank is named."""
    from hyper_parallel.codegen.check.verify_mode import max_processes

    world = spec.layout.world_size
    if world > max_processes():
        return preflight_in_process(spec)
    what = f"preflight on {world} ranks for {spec.bundle_dir}"
    with scratch_dir("preflight") as tmp:
        files = RankFiles(str(tmp / "preflight"))
        cmd = torchrun_command(world, "hyper_parallel.codegen.check.preflight_worker",
                               ["--config", str(spec.recipe_path), "--reports", files.prefix,
                                "--timeout-s", str(spec.check_timeout_s)], rank_preload(spec.source))
        _LOG.info(f"[preflight] torchrun --nproc_per_node={world} preflight of {spec.bundle_dir}")
        env = {**os.environ, "HYPER_PARALLEL_WORKSPACE": str(spec.workspace.parent)}
        try:
            with RankLaunch(cmd, log=tmp / "preflight.log", env=env) as launch:
                wait_for_ranks(launch, files, world, what=what, timeout_s=PREFLIGHT_TIMEOUT_S,
                               collective_timeout_s=spec.check_timeout_s)
        except LaunchError as exc:
            reason = str(exc)
            fix = "" if "fix:" in reason else f"\n  fix: {fix_command(spec)}"
            raise PreflightError(f"{reason}{fix}") from None
        reports = [json.loads(files.result(rank).read_text()) for rank in range(world)]
    digests = {report["digest"] for report in reports}
    if len(digests) != 1:
        differing = "; ".join(f"rank {i}: bundle digest {r['digest']} differs from rank 0's {reports[0]['digest']}"
                              for i, r in enumerate(reports) if r["digest"] != reports[0]["digest"])
        raise PreflightError(f"{what} failed: {differing}\n  fix: {fix_command(spec)}")
    report = {**reports[0], "ok": True, "world_size": world}
    _LOG.info(f"[preflight] ok on {world} ranks: {report['params_checked']} parameters' local shards match the plan; "
              f"bundle digest {report['digest'][:12]} identical on every rank")
    return report


def checked_meta_model(spec: CodegenSpec, fix: str) -> tuple[dict[str, Any], Any, Any]:
    """What both preflights start from: the installed bundle's integrity, its module, and
    the full-size model on the meta device, which its plan must cover."""
    from hyper_parallel.codegen.loader import load_generated_module
    from hyper_parallel.codegen.plan.derive import build_meta_model
    from hyper_parallel.codegen.spec.project import signature_from_spec

    report = preflight_integrity_check(spec.bundle_dir, expected_signature=signature_from_spec(spec), fix=fix)
    module = load_generated_module(spec.bundle_dir)
    meta = load_codegen_meta(spec.bundle_dir)
    model, _ = build_meta_model(spec, getattr(module, meta["model"]["model_class"]))
    preflight_integrity_check(spec.bundle_dir, model=model, fix=fix)
    return report, module, model


def preflight_in_process(spec: CodegenSpec) -> dict[str, Any]:
    """For a world larger than the host may start: integrity, import and plan coverage on
    the full-size meta-device model, and each rank's shard of every parameter computed from
    the plan (none may be empty). The plan itself ran at this world size in verify; the
    bundle digests are compared across ranks when training starts."""
    from hyper_parallel.distributed.mesh import OfflineMesh, expert_mesh_layout, mesh_layout
    from hyper_parallel.distributed.name_match import plan_entry_for
    from hyper_parallel.protocols.placement_text import local_shard_shape

    fix = fix_command(spec)
    report, module, model = checked_meta_model(spec, fix)
    p = spec.layout
    dims = p.dims
    layouts = {"main": mesh_layout(dims), "expert": expert_mesh_layout(dims)}
    modules = plan_entries(module.HYPER_PARALLEL_PLAN)
    checked = 0
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        key, entry = plan_entry_for(owner, modules)
        placement = entry["state_shardings"][leaf]
        axes, sizes = layouts["expert" if "ep" in placement else "main"]
        for rank in range(p.world_size):
            coords = list(OfflineMesh(tuple(axes), tuple(sizes)).coordinates(rank))
            shape = local_shard_shape(tuple(param.shape), placement, list(axes), list(sizes), coords)
            if 0 in shape and 0 not in param.shape:
                raise PreflightError(f"{name}: plan entry {key!r} leaves rank {rank} an empty shard {shape} of "
                                     f"{tuple(param.shape)}\n  fix: {fix}")
        checked += 1
    _LOG.info(f"[preflight] ok in one process for {p.world_size} ranks (above the process cap): {checked} "
              f"parameters' shards computed for every rank; bundle digest {report['digest'][:12]} "
              f"(compared across ranks at training start)")
    return {**report, "params_checked": checked, "world_size": p.world_size, "mode": "in_process"}
