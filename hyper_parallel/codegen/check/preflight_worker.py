"""One rank of the torchrun preflight: integrity, import, apply the plan on the real
mesh to a meta-device model, check local shard shapes, compare bundle digests.

Run by ``run_torchrun_preflight``; not meant to be started by hand.
"""

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyper_parallel.codegen.check.preflight_worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--report", required=True)
    args = parser.parse_args(argv)

    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    dist.init_process_group("gloo")
    try:
        report = _check_rank(args.config, rank, dist)
        error = None
    except Exception as exc:  # every rank reports; rank 0 writes what failed where
        report, error = None, f"rank {rank}: {type(exc).__name__}: {exc}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    failures = [e for e in errors if e]
    if not failures:
        digests = {r["digest"] for r in reports}
        if len(digests) != 1:
            failures = [f"rank {i}: bundle digest {r['digest']} differs from rank 0's {reports[0]['digest']}"
                        for i, r in enumerate(reports) if r["digest"] != reports[0]["digest"]]
    if rank == 0:
        out = {"ok": not failures, "error": "\n".join(failures) or None, "world_size": dist.get_world_size()}
        if not failures:
            out.update(digest=reports[0]["digest"], params_checked=reports[0]["params_checked"],
                       plan_entries=reports[0]["plan_entries"])
        Path(args.report).write_text(json.dumps(out, indent=1))
    dist.barrier()
    # Every rank has reported and met; leave without tearing down the process group and
    # the interpreter: that teardown now and then aborts a rank ("terminate called
    # without an active exception", SIGABRT) after all checks passed, failing the launch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if not failures else 1)


def _check_rank(config_path: str, rank: int, dist) -> dict:
    from hyper_parallel.codegen.check.preflight import PreflightError, checked_meta_model
    from hyper_parallel.codegen.spec.project import check_launch_world_size, project_codegen_spec
    from hyper_parallel.config import load_training_config
    from hyper_parallel.distributed.applier import plan_entry_for
    from hyper_parallel.distributed.placement_text import local_shard_shape
    from hyper_parallel.distributed.mesh import MeshContext, ParallelDims, build_device_mesh

    config = load_training_config(config_path)
    check_launch_world_size(config)
    spec = project_codegen_spec(config)  # workspace from $HYPER_PARALLEL_WORKSPACE
    fix = f"doit generate config={config_path}"
    report, module, model = checked_meta_model(spec, fix)
    p = spec.parallel
    dims = ParallelDims(dp=p.dp, cp=p.cp, tp=p.tp, ep=p.ep, pp=p.pp)
    mesh = build_device_mesh(dims, "cpu")  # preflight checks layout, not kernels: gloo everywhere
    global_shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
    module.hyper_parallelize(model, MeshContext(device_mesh=mesh, dims=dims))
    plan = module.HYPER_PARALLEL_PLAN
    checked = 0
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        key, entry = plan_entry_for(owner, plan["modules"])
        # Each parameter lives on its own (sub-)mesh: the tp mesh, or the expert mesh for ep.
        param_mesh = getattr(param, "device_mesh", mesh)
        expected = local_shard_shape(global_shapes[name], entry["state_shardings"][leaf],
                                     list(param_mesh.mesh_dim_names), list(param_mesh.mesh.shape),
                                     list(param_mesh.get_coordinate()))
        local = param.to_local() if hasattr(param, "to_local") else param
        if tuple(local.shape) != tuple(expected):
            raise PreflightError(f"{name}: local shard shape {tuple(local.shape)} on rank {rank}, "
                                 f"plan entry {key!r} expects {tuple(expected)}")
        checked += 1
    report["params_checked"] = checked
    return report


if __name__ == "__main__":
    sys.exit(main())
