"""One rank of the torchrun preflight: integrity, import, apply the plan on the real
mesh to a meta-device model, check local shard shapes, compare bundle digests.

Run by ``run_torchrun_preflight``; not meant to be started by hand.
"""

import argparse
import json
import os
import sys
from datetime import timedelta

from hyper_parallel.launch.ranks import RankFiles, join_process_group
from hyper_parallel.distributed.rank_exit import exit_rank


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyper_parallel.codegen.check.preflight_worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--reports", required=True, help="prefix of the per-rank report files")
    parser.add_argument("--timeout-s", type=float, required=True, help="collective timeout")
    parser.add_argument("--set", action="append", default=[], help="the recipe's --set items, as generate had them")
    args = parser.parse_args(argv)

    import torch.distributed as dist

    files = RankFiles(args.reports)
    rank = int(os.environ.get("RANK", "0"))
    if not join_process_group(files, rank, lambda: dist.init_process_group(
            "gloo", timeout=timedelta(seconds=args.timeout_s)), args.timeout_s):
        exit_rank(1)
    try:
        report = _check_rank(args.config, args.set, rank, lambda phase: files.report_progress(rank, phase))
        error = None
    except Exception as exc:  # each rank reports its own error: no collective a silent rank could block
        report, error = None, f"rank {rank}: {type(exc).__name__}: {exc}"
    if error:
        files.report_error(rank, error)
    else:
        files.result(rank).write_text(json.dumps(report))
        files.report_progress(rank, "done")
        try:
            dist.barrier()  # nobody leaves while a peer may still be receiving from it
        except RuntimeError:
            pass
    exit_rank(1 if error else 0)


def _check_rank(config_path: str, overrides: list[str], rank: int, progress) -> dict:
    from hyper_parallel.codegen.check.preflight import PreflightError, checked_meta_model
    from hyper_parallel.codegen.spec.project import project_codegen_spec
    from hyper_parallel.config import load_training_config
    from hyper_parallel.config.launch import check_launch_world_size
    from hyper_parallel.distributed.mesh import MeshContext, build_device_mesh
    from hyper_parallel.distributed.name_match import placed_parameters
    from hyper_parallel.distributed.plan_format import plan_entries
    from hyper_parallel.protocols.placement_text import local_shard_shape

    config = load_training_config(config_path, overrides)
    check_launch_world_size(config)
    spec = project_codegen_spec(config)  # workspace from $HYPER_PARALLEL_WORKSPACE
    fix = f"doit generate config={config_path}"
    progress("checking the bundle")
    report, module, model = checked_meta_model(spec, fix)
    p = spec.layout
    dims = p.dims
    mesh = build_device_mesh(dims, "cpu")  # preflight checks layout, not kernels: gloo everywhere
    global_shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
    progress("applying hyper_parallelize")
    module.hyper_parallelize(model, MeshContext(device_mesh=mesh, layout=p))
    placed = placed_parameters([name for name, _ in model.named_modules()], plan_entries(module.HYPER_PARALLEL_PLAN))
    checked = 0
    for name, param in model.named_parameters():
        found = placed.get(name)  # None: a frozen parameter no entry places stays whole
        key = found.key if found else None
        # Each parameter lives on its own (sub-)mesh: the tp mesh, or the expert mesh for ep.
        param_mesh = getattr(param, "device_mesh", mesh)
        # An axis of one rank splits nothing, and the applier leaves it out of the parameter's
        # mesh (tp 1 under cp 2): the entry's placement on it says nothing about the shard.
        placement = {axis: text for axis, text in (found.placement if found else {}).items()
                     if axis in param_mesh.mesh_dim_names or getattr(dims, str(axis), 0) != 1}
        expected = local_shard_shape(global_shapes[name], placement,
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
