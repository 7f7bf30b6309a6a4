"""The ranks of the verify stage: run a bundle's generated model, sharded by its own
``hyper_parallelize`` (and FSDP2 over dp, as the trainer applies it), on the probe.

Two ways to run the same ``run_rank`` (verify_ranks.py):

- ``--mode torchrun``: one process per rank under torchrun, gloo collectives;
- ``--mode threads --world N``: every rank a thread of this one process, over torch's
  threaded process group (real collectives between threads, no sockets). It needs no
  more processes than one, so a 64- or 256-rank layout verifies on a laptop.

Each rank steps the model with the trainer's own step (runtime/train_step.py's
``TrainStep``) and AdamW (distributed/optimizer.py), so what verify proves is what
training runs; between backward and update it gathers every whole gradient
(gathered_grads.py).

Rank 0 writes what the verify launcher compares: per step the loss, the global gradient
norm and every parameter's gathered gradient (and, with ``--diagnose``, each module's
forward output). Not meant to be started by hand: ``verify.py`` writes the job.
"""

import argparse
import contextlib
import json
import sys
import threading
from pathlib import Path
from typing import Any

from hyper_parallel.codegen.check.gathered_grads import gathered_grads
from hyper_parallel.codegen.check.verify_mode import STEPS
from hyper_parallel.codegen.check.verify_ranks import (
    load_bundle_module,
    progress,
    run_threads,
    run_torchrun,
    track_running,
)

LR = 1e-3
VERIFY_SEED = 0


def seed_step(step: int) -> None:
    """verify's step seed (``distributed.step_seed``), the reference's and every rank's."""
    from hyper_parallel.distributed.step_seed import seed_step as seeded

    seeded(step, VERIFY_SEED)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyper_parallel.codegen.check.verify_worker")
    parser.add_argument("--job", required=True, help="the job file the verify launcher wrote")
    parser.add_argument("--mode", choices=("torchrun", "threads"), required=True)
    parser.add_argument("--world", type=int, default=0, help="ranks to simulate (threads mode)")
    args = parser.parse_args(argv)
    job = json.loads(Path(args.job).read_text())
    if args.mode == "threads":
        return run_threads(job, args.world, run_rank)
    return run_torchrun(job, run_rank)


def build_probe_model(job: dict[str, Any]):
    """The bundle's generated class on the probe config, with the reference's weights."""
    import torch

    module = load_bundle_module(job)
    model_class = getattr(module, job["model_class"])
    config = model_class.config_class.from_pretrained(job["probe_dir"])
    config._attn_implementation = job["attn_implementation"]
    state = torch.load(Path(job["probe_dir"]) / "probe.pt", weights_only=True)
    model = model_class(config).to(torch.float32)
    try:
        model.load_state_dict(state["weights"], strict=True)
    except RuntimeError as exc:
        raise RuntimeError(f"the generated model {job['model_class']} does not take the reference model's "
                           f"weights (a replace_module that changes shapes or names?): {exc}") from None
    return module, model.train(), state["tokens"]


def probe_plan(plan: dict[str, Any], model) -> dict[str, Any]:
    """The plan without the entries of decoder layers the probe cut off: the probe keeps the
    shortest prefix of layers holding every layer kind, so a per-layer key beyond it (a
    decoder layer's own entry, ``model.layers.1``, which no glob can merge without also
    matching the layer's submodules) names a module the probe does not have, and a layer
    of its kind is in the prefix."""
    from hyper_parallel.distributed.model_parts import decoder_layers

    found = decoder_layers(model)
    if found is None:
        return plan
    prefix, depth = found[0] + ".", len(found[1])

    def cut_off(key: str) -> bool:
        index = key[len(prefix):].split(".", 1)[0] if key.startswith(prefix) else ""
        return index.isdigit() and int(index) >= depth

    return {**plan, "modules": {key: entry for key, entry in plan["modules"].items() if not cut_off(key)}}


# Thread ranks build their whole probe model and shard it one at a time (no collective
# may run in between: the meshes are built before): otherwise every rank holds a whole
# model at once, which at 256 ranks was most of the process's peak memory.
_ONE_WHOLE_MODEL = threading.Lock()


def run_rank(job: dict[str, Any], running: list[str], finished: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from hyper_parallel.distributed.optimizer import build_adamw
    from hyper_parallel.config.layout import Layout
    from hyper_parallel.distributed.mesh import MeshContext, build_device_mesh, build_expert_mesh
    from hyper_parallel.runtime.assembly import RuntimeOptions, apply_runtime
    from hyper_parallel.runtime.train_step import TrainStep

    rank = dist.get_rank()
    layout = Layout.from_dict(job["layout"], where="verify job")
    dims = layout.dims
    progress(job, "building the mesh")
    mesh = build_device_mesh(dims, "cpu")
    context = MeshContext(device_mesh=mesh, layout=layout)
    if dims.ep > 1:  # its process groups are collective: built by every rank before the lock below
        context.expert_mesh = build_expert_mesh(dims, "cpu")
    with _ONE_WHOLE_MODEL if job["mode"] == "threads" else contextlib.nullcontext():
        progress(job, "building the probe model")
        module, model, tokens = build_probe_model(job)
        whole = {name: (tuple(param.shape), param.dtype) for name, param in model.named_parameters()}
        if job["pipeline"]:
            _keep_this_ranks_stages(job, model, layout, mesh)
        progress(job, "applying hyper_parallelize")
        module.HYPER_PARALLEL_PLAN = probe_plan(module.HYPER_PARALLEL_PLAN, model)
        module.hyper_parallelize(model, context)
    track_running(model, module.HYPER_PARALLEL_PLAN["modules"], running, finished)
    apply_runtime(model, context, RuntimeOptions(where="verify"))  # FSDP2 over dp, as training applies it
    if dims.dp > 1 and job["mode"] == "threads":
        _sum_then_divide(model)
    pipeline = PipelineRun(job, model, layout, mesh) if job["pipeline"] else None
    dp_rank = mesh.get_local_rank("dp") if dims.dp > 1 else 0
    if job["diagnose"]:
        from hyper_parallel.codegen.check.module_outputs import module_outputs

        outputs = module_outputs(model, tokens[:1], pipeline=pipeline)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, outputs)
        if rank == 0:
            torch.save({"outputs": gathered}, job["result"])
        return
    # The trainer's step (runtime/train_step.py) with the trainer's AdamW, at torch's default settings
    train_step = TrainStep(model, build_adamw(model.parameters(), lr=LR), mesh=mesh, dp=dims.dp, pp=dims.pp,
                           pipeline=pipeline.schedule if pipeline else None, tied=pipeline.tied if pipeline else None)
    record: dict[str, list] = {"losses": [], "norms": [], "grads": [], "spreads": []}
    per_rank = job["pipeline"]["microbatches"] if pipeline else 1
    for step in range(STEPS):
        progress(job, f"step {step + 1}")
        batch = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        seed_step(step)
        value = train_step.mean_over_dp(train_step.forward_backward([batch]))  # a pipeline splits its own rows
        grads, spreads = gathered_grads(model, whole, pipelined=pipeline is not None)
        record["norms"].append(train_step.grad_norm())
        record["losses"].append(value.item())
        record["spreads"].append(spreads)
        # Only rank 0 writes the record: the others drop their copy of the whole gradients
        # at once (at 256 thread ranks, every rank's copy was most of the process's memory).
        record["grads"].append(grads if rank == 0 else None)
        del grads
        train_step.update()
    if rank == 0:
        torch.save(record, job["result"])


def _keep_this_ranks_stages(job: dict[str, Any], model, layout, mesh) -> None:
    """Under pp: take out of the probe model what other pipeline stages run, as training
    does (distributed/pipeline.py), on the probe's split; first refuse, as derive does, a
    generated model whose stages would not compute the whole model."""
    from hyper_parallel.distributed.pipeline import check_stage_handoff, prune_to_stage

    check_stage_handoff(model)
    stages = tuple(tuple(stage) for stage in job["pipeline"]["stages"])
    prune_to_stage(model, stages, layout.pipeline.stages_of_rank(mesh.get_local_rank("pp"), layout.pp))


class PipelineRun:
    """This rank's stages as the trainer builds them: the recipe's schedule
    (``build_schedule``) and the tied embeddings' gradients summed across the end stages
    (``TiedEmbeddingGradients``), which the trainer's step (``TrainStep``) runs."""

    def __init__(self, job: dict[str, Any], model, layout, mesh):
        import torch

        from hyper_parallel.distributed.pipeline import TiedEmbeddingGradients, build_schedule, tied_embeddings

        self.model, self.group = model, mesh.get_group("pp")
        self.microbatches = job["pipeline"]["microbatches"]
        self.schedule = build_schedule(model, schedule=layout.pipeline.schedule, microbatches=self.microbatches,
                                       pp_group=self.group, device=torch.device("cpu"))
        self.tied = TiedEmbeddingGradients(model, mesh, layout.pipeline) if tied_embeddings(model) else None

    def forward(self, batch) -> None:
        """A forward-only run of ``batch`` once per micro-batch (each stage's modules run
        once per micro-batch, on the same tokens)."""
        from hyper_parallel.distributed.pipeline import through_pipeline

        through_pipeline(self.model, self.schedule.eval, batch.repeat(self.microbatches, 1), self.group)


def _sum_then_divide(model) -> None:
    """The threaded process group reduces with SUM and AVG only; FSDP2's pre-scaled sum
    (where a gradient divide factor is set on a group of more than one rank: experts under
    ep with edp > 1) becomes a sum followed by the same division. The one place the
    simulated ranks run other collectives. (On a one-rank group FSDP2 divides by the
    factor itself, and forcing the sum there would divide twice.)"""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None and group.gradient_divide_factor is not None and group.mesh_info.shard_mesh_size > 1:
            module.set_force_sum_reduction_for_comms(True)


if __name__ == "__main__":
    sys.exit(main())
