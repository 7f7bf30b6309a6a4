"""Preflight, the build tool's stage: the per-rank integrity checks (``runtime/integrity.py``,
which training runs too) on ``world_size`` ranks under torchrun, or in one process above
the process cap."""

import json
import logging
import os
from typing import Any

from hyper_parallel.codegen.check.drift import fix_command
from hyper_parallel.codegen.check.rank_preload import rank_preload
from hyper_parallel.codegen.spec.types import CodegenSpec
from hyper_parallel.distributed.plan_format import plan_entries
from hyper_parallel.launch.forked_torchrun import torchrun_command
from hyper_parallel.launch.ranks import LaunchError, RankFiles, RankLaunch, scratch_dir, wait_for_ranks
from hyper_parallel.runtime.integrity import PreflightError, preflight_integrity_check
from hyper_parallel.runtime.meta import load_codegen_meta

_LOG = logging.getLogger(__name__)

PREFLIGHT_TIMEOUT_S = 900


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
                               ["--config", str(spec.recipe_path), *(f"--set={item}" for item in spec.recipe_overrides),
                                "--reports", files.prefix,
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
    from hyper_parallel.runtime.loader import load_generated_module
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
    from hyper_parallel.distributed.mesh import expert_mesh_layout, mesh_layout
    from hyper_parallel.distributed.name_match import placed_parameters
    from hyper_parallel.planning.offline_mesh import OfflineMesh
    from hyper_parallel.protocols.placement_text import local_shard_shape

    fix = fix_command(spec)
    report, module, model = checked_meta_model(spec, fix)
    p = spec.layout
    dims = p.dims
    layouts = {"main": mesh_layout(dims), "expert": expert_mesh_layout(dims)}
    placed = placed_parameters([name for name, _ in model.named_modules()], plan_entries(module.HYPER_PARALLEL_PLAN))
    checked = 0
    for name, param in model.named_parameters():
        if name not in placed:  # a frozen parameter no entry places: whole on every rank
            continue
        key, placement = placed[name].key, placed[name].placement
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
