"""The ranks of the verify stage: run a bundle's generated model, sharded by its own
``hyper_parallelize`` (and FSDP2 over dp, as the trainer applies it), on the probe.

Two ways to run the same ``run_rank``:

- ``--mode torchrun``: one process per rank under torchrun, gloo collectives;
- ``--mode threads --world N``: every rank a thread of this one process, over torch's
  threaded process group (real collectives between threads, no sockets). It needs no
  more processes than one, so a 64- or 256-rank layout verifies on a laptop.

Rank 0 writes what the verify launcher compares: per step the loss, the global gradient
norm and every parameter's gathered gradient (and, with ``--diagnose``, each module's
forward output). Not meant to be started by hand: ``verify.py`` writes the job.
"""

import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import sys
import threading
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from hyper_parallel.codegen.check import threaded_p2p
from hyper_parallel.codegen.check.verify_mode import STEPS
from hyper_parallel.launch.ranks import RankFiles, join_process_group
from hyper_parallel.distributed.rank_exit import exit_rank
from hyper_parallel.errors import HyperParallelError

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
        return run_threads(job, args.world)
    return run_torchrun(job)


def run_torchrun(job: dict[str, Any]) -> int:
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    if not join_process_group(RankFiles(job["rank_files"]), rank, lambda: dist.init_process_group(
            "gloo", timeout=timedelta(seconds=job["timeout_s"])), job["timeout_s"]):
        exit_rank(1)
    error = _guarded_rank(job)
    # Each rank reports on its own (no collective that a silent rank could block), so the
    # launcher can name a rank that never reported.
    if error:
        RankFiles(job["rank_files"]).report_error(rank, error)
    else:
        progress(job, "done")
        try:
            dist.barrier()  # nobody leaves while a peer may still be receiving from it
        except RuntimeError:
            pass
    exit_rank(1 if error else 0)


def progress(job: dict[str, Any], phase: str) -> None:
    """Record how far this rank got (the launcher names the last phase of a silent rank)."""
    import torch.distributed as dist

    if job["mode"] == "torchrun":
        RankFiles(job["rank_files"]).report_progress(dist.get_rank(), phase)


def run_threads(job: dict[str, Any], world: int) -> int:
    """Every rank a thread; the first failing rank wakes the others (they raise too)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    store = dist.HashStore()
    errors: list[tuple[int, str]] = []
    _load_bundle_module(job)  # import once, before the threads share it

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store,
                                timeout=timedelta(seconds=job["timeout_s"]))
        error = _guarded_rank(job)
        if error:
            errors.append((rank, error))
            ProcessLocalGroup.exception_handle(RuntimeError(error))

    threads = [threading.Thread(target=worker, args=(rank,), daemon=True) for rank in range(world)]
    with threaded_p2p.installed():  # pipeline stages send to each other
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=job["timeout_s"])
    silent = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    _uninstall_threaded_pg()
    if silent:
        errors.append((silent[0], f"rank {silent[0]}: did not finish within {job['timeout_s']}s "
                                  f"(ranks {silent} still running)"))
    if errors:
        # The first error is the cause; the others are woken ranks raising after it.
        Path(job["error"]).write_text(sorted(errors, key=lambda e: "terminat" in e[1].lower())[0][1])
        return 1
    return 0


def _guarded_rank(job: dict[str, Any]) -> str | None:
    import torch.distributed as dist

    rank = dist.get_rank()
    running: list[str] = []
    finished: list[str] = []
    try:
        run_rank(job, running, finished)
        return None
    except Exception as exc:
        detail = traceback.format_exc() if os.environ.get("HYPER_PARALLEL_TRACEBACK") else ""
        where = ""
        if running:
            where = f" in {running[-1]}{_plan_key_of(job, running[-1])}"
            # What fed it: the planned modules that ran inside the innermost running
            # module that had any (the crashing module, or its block: q_norm -> self_attn).
            for outer in reversed(running):
                inside = [name for name in finished if name.startswith(outer + ".") and name != running[-1]]
                if inside:
                    where += f"; planned modules that ran inside {outer} first: " + "; ".join(
                        f"{name}{_plan_key_of(job, name)}" for name in dict.fromkeys(inside))
                    break
        return f"rank {rank}: {type(exc).__name__}: {exc}{where}{detail}"


def _plan_key_of(job: dict[str, Any], fqn: str) -> str:
    """The plan entry that was applied to ``fqn``, or to its nearest planned parent."""
    from hyper_parallel.distributed.name_match import plan_entry_for

    plan = _load_bundle_module(job).HYPER_PARALLEL_PLAN["modules"]
    name = fqn
    while True:
        found = plan_entry_for(name, plan)
        if found is not None:
            return f" (plan entry {found[0]!r}: {brief_entry(found[1])})"
        if not name:
            return " (no plan entry)"
        name = name.rpartition(".")[0]


def brief_entry(entry: dict[str, Any] | str) -> str | dict[str, Any]:
    """An entry as the generated file spells it (one line), for a diagnosis to quote."""
    from hyper_parallel.protocols.sharding_json import entry_line, full_entry

    return entry_line(full_entry(entry))


def _track_running(model, plan: dict[str, Any], running: list[str], finished: list[str]) -> None:
    """Keep the innermost module whose forward is running and the last module with a plan
    entry of its own to finish, so a crash names both."""
    from hyper_parallel.distributed.name_match import plan_entry_for

    def enter(name):
        def hook(module, args):
            running.append(name)
        return hook

    def leave(name, planned):
        def hook(module, args, output):
            if running:
                running.pop()
            if planned:
                finished.append(name)
        return hook

    for name, module in model.named_modules():
        module.register_forward_pre_hook(enter(name))
        module.register_forward_hook(leave(name, plan_entry_for(name, plan) is not None))


def _load_bundle_module(job: dict[str, Any]):
    from hyper_parallel.runtime.loader import load_bundle_module

    return load_bundle_module(job["bundle_dir"], job["modeling_file"], job["bundle_key"], job["files"])


def build_probe_model(job: dict[str, Any]):
    """The bundle's generated class on the probe config, with the reference's weights."""
    import torch

    module = _load_bundle_module(job)
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

    from hyper_parallel.distributed.grad_norm import global_grad_norm
    from hyper_parallel.config.layout import Layout
    from hyper_parallel.distributed.mesh import MeshContext, build_device_mesh, build_expert_mesh

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
    _track_running(model, module.HYPER_PARALLEL_PLAN["modules"], running, finished)
    if dims.dp > 1:
        from hyper_parallel.distributed.fsdp import fully_shard_over_dp

        expert_mesh = context.expert_mesh
        fully_shard_over_dp(model, mesh["dp"], expert_dp_mesh=expert_mesh["edp"] if expert_mesh is not None else None)
        if job["mode"] == "threads":
            _sum_then_divide(model)
    pipeline = PipelineRun(job, model, layout, mesh) if job["pipeline"] else None
    dp_rank = mesh.get_local_rank("dp") if dims.dp > 1 else 0
    if job["diagnose"]:
        outputs = module_outputs(model, tokens[:1], pipeline=pipeline)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, outputs)
        if rank == 0:
            torch.save({"outputs": gathered}, job["result"])
        return
    optimizer = LocalShardAdamW(model.parameters(), lr=LR)
    record: dict[str, list] = {"losses": [], "norms": [], "grads": [], "spreads": []}
    per_rank = job["pipeline"]["microbatches"] if pipeline else 1
    for step in range(STEPS):
        progress(job, f"step {step + 1}")
        batch = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        seed_step(step)
        if pipeline is not None:
            value = pipeline.step(batch)
        else:
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            value = loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
        if dims.dp > 1:
            dist.all_reduce(value, group=mesh.get_group("dp"))
            value = value / dims.dp
        grads, spreads = gathered_grads(model, whole, pipelined=pipeline is not None)
        counted = pipeline.counted() if pipeline is not None else model.parameters()
        record["norms"].append(global_grad_norm(counted, pp=dims.pp))
        record["losses"].append(value.item())
        record["spreads"].append(spreads)
        # Only rank 0 writes the record: the others drop their copy of the whole gradients
        # at once (at 256 thread ranks, every rank's copy was most of the process's memory).
        record["grads"].append(grads if rank == 0 else None)
        del grads
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if rank == 0:
        torch.save(record, job["result"])


class LocalShardAdamW:
    """Verify's AdamW, stepping each parameter's local shard as a plain tensor. AdamW is
    elementwise, so this is the update DTensor's own dispatch would make (the same local
    operations), without its per-operation sharding propagation: with DTensor parameters
    that was most of a thread-mode verify (64 ranks in one process, each of about a dozen
    operations per parameter per step through Python). A gradient placed otherwise than
    its parameter (a partial sum left pending) is redistributed to the parameter's
    placements first."""

    def __init__(self, params, *, lr: float):
        import torch
        from torch.distributed.tensor import DTensor

        self.params = list(params)
        # detached views of the same storage: the inner optimizer's in-place updates are the parameters'
        self.shards = [p.detach().to_local() if isinstance(p, DTensor) else p.detach() for p in self.params]
        self.inner = torch.optim.AdamW(self.shards, lr=lr, foreach=False)  # as the one-process reference

    def step(self) -> None:
        from torch.distributed.tensor import DTensor

        for param, shard in zip(self.params, self.shards):
            grad = param.grad
            if isinstance(grad, DTensor):
                if tuple(grad.placements) != tuple(param.placements):
                    grad = grad.redistribute(param.device_mesh, param.placements)
                grad = grad.to_local()
            shard.grad = grad
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param, shard in zip(self.params, self.shards):
            param.grad = shard.grad = None


def _keep_this_ranks_stages(job: dict[str, Any], model, layout, mesh) -> None:
    """Under pp: take out of the probe model what other pipeline stages run, as training
    does (distributed/pipeline.py), on the probe's split; first refuse, as derive does, a
    generated model whose stages would not compute the whole model."""
    from hyper_parallel.distributed.pipeline import check_stage_handoff, prune_to_stage

    check_stage_handoff(model)
    stages = tuple(tuple(stage) for stage in job["pipeline"]["stages"])
    prune_to_stage(model, stages, layout.pipeline.stages_of_rank(mesh.get_local_rank("pp"), layout.pp))


class PipelineRun:
    """This rank's stages run by the recipe's schedule, as the trainer runs them: the
    schedule (``build_schedule``), a step's loss (``through_pipeline``), tied embeddings'
    gradients summed across the end stages (``TiedEmbeddingGradients``)."""

    def __init__(self, job: dict[str, Any], model, layout, mesh):
        import torch

        from hyper_parallel.distributed.pipeline import TiedEmbeddingGradients, build_schedule, tied_embeddings

        self.model, self.group = model, mesh.get_group("pp")
        self.microbatches = job["pipeline"]["microbatches"]
        self.schedule = build_schedule(model, schedule=layout.pipeline.schedule, microbatches=self.microbatches,
                                       pp_group=self.group, device=torch.device("cpu"))
        self.tied = TiedEmbeddingGradients(model, mesh, layout.pipeline) if tied_embeddings(model) else None

    def step(self, rows):
        """Forward and backward of ``rows`` (one micro-batch each); this dp rank's mean loss."""
        from hyper_parallel.distributed.pipeline import through_pipeline

        total = through_pipeline(self.model, self.schedule.step, rows, self.group, return_outputs=False)
        if self.tied is not None:
            self.tied.sum()
        return total

    def forward(self, batch) -> None:
        """A forward-only run of ``batch`` once per micro-batch (each stage's modules run
        once per micro-batch, on the same tokens)."""
        from hyper_parallel.distributed.pipeline import through_pipeline

        through_pipeline(self.model, self.schedule.eval, batch.repeat(self.microbatches, 1), self.group)

    def counted(self):
        """The parameters the gradient norm sums over (the tied matrix once)."""
        return self.tied.counted() if self.tied is not None else self.model.parameters()


def gathered_grads(model, whole: dict[str, tuple], *, pipelined: bool) -> tuple[dict, dict]:
    """Every parameter's whole gradient (``_gather``) and its replicas' spread, by the whole
    model's names (``whole``: name -> (shape, dtype)): under pp each rank holds only its
    stages' parameters and gives nothing for the others, but every rank takes part in every
    gather, in one order."""
    import torch.distributed as dist

    from hyper_parallel.distributed.local_views import packed_rows

    held = dict(model.named_parameters())
    packed = packed_rows(model)
    with_grad = {name for name, param in held.items() if param.grad is not None}
    if pipelined:  # which names have a gradient somewhere
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, sorted(with_grad))
        with_grad = set().union(*map(set, found))
    names = [name for name in whole if name in with_grad]
    pieces = []
    for name in names:
        param = held.get(name)
        try:
            pieces.append(_local_piece(None if param is None else param.grad, *whole[name], packed.get(name)))
        except RuntimeError as exc:
            raise RuntimeError(f"gathering the gradient of {name}: {exc}") from exc
    try:
        gathered = _gather_pieces(pieces, [whole[name] for name in names])
    except _NotHeld as exc:
        raise RuntimeError(f"gathering the gradient of {names[exc.position]}: {exc}") from None
    grads = {name: None for name in whole}
    grads.update((name, result[0]) for name, result in zip(names, gathered))
    return grads, {name: result[1] for name, result in zip(names, gathered)}


def _gather(tensor, shape: tuple[int, ...], dtype, rows=None) -> tuple[Any, float]:
    """One tensor's ``_gather_pieces``: its whole on rank 0 (None on the others) and the
    spread of its replicas."""
    return _gather_pieces([_local_piece(tensor, shape, dtype, rows)], [(shape, dtype)])[0]


class _NotHeld(RuntimeError, HyperParallelError):
    """No rank holds some elements of the tensor at ``position`` of a gather."""

    def __init__(self, position: int):
        super().__init__("no rank holds some elements of the tensor")
        self.position = position


def _local_piece(tensor, shape: tuple[int, ...], dtype, rows=None) -> tuple[Any, Any]:
    """This rank's piece of a tensor of ``shape``: (element numbers, values), flat. Where
    each piece sits: ``local_elements`` on an index grid; a plain tensor is one piece every
    rank holds; None: a rank that holds none of it (another pipeline stage's parameter).
    (DTensor's ``full_tensor`` cannot undo FSDP2's strided shard over edp on expert weights
    that are sharded over ep as well, nor a packed parameter's order: ``rows``, its
    ``local_views.PackedRows``.) A DTensor with a sum pending is reduced here, a
    collective of its mesh's ranks."""
    import torch
    from torch.distributed.tensor import DTensor, Partial

    numel = math.prod(shape)
    # element numbers as int32 where they fit: every thread rank holds one such grid at once
    index = torch.arange(numel, dtype=_index_dtype(numel)).reshape(shape)
    if tensor is None:
        return index.reshape(-1)[:0].clone(), torch.zeros(0, dtype=dtype)
    if isinstance(tensor, DTensor):
        if any(isinstance(p, Partial) for p in tensor.placements):
            local = tensor.full_tensor()  # a sum still pending: DTensor reduces it
        else:
            mesh = tensor.device_mesh
            if rows is not None:  # the stored tensor's elements, in packed order
                index = index.index_select(rows.dim, rows.stored_rows())
            index = local_elements(index, tensor.placements, [mesh.size(dim) for dim in range(mesh.ndim)],
                                   mesh.get_coordinate())
            local = tensor.to_local()
    else:
        local = tensor
    if local.numel() != index.numel():
        raise RuntimeError(f"this rank's piece has {local.numel()} elements where its placements give "
                           f"{index.numel()} of the whole {tuple(shape)}")
    return index.reshape(-1).clone(), local.detach().reshape(-1)  # (the whole grid freed)


def _index_dtype(numel: int):
    import torch

    return torch.int32 if numel < 2**31 else torch.int64


def _gather_pieces(pieces: list[tuple[Any, Any]], wholes: list[tuple[tuple[int, ...], Any]]) -> list[tuple[Any, float]]:
    """Per tensor (``pieces[i]``: this rank's, ``wholes[i]``: its (shape, dtype)): the
    whole tensor on rank 0 (None on the others), rebuilt from every rank's piece, and how
    far the ranks' copies of the same element disagree: replicas that differ would train
    different weights, so averaging them must not hide it.

    Only rank 0 compares: the pieces are gathered to it, so no other rank holds a
    whole-sized buffer (at 256 thread ranks, every rank's whole-sized sum and count were
    most of verify's memory). All tensors travel in one exchange, four collectives in all:
    at 256 thread ranks each collective costs about a second of waking threads, and one
    exchange per tensor was most of verify's time. An element no rank holds makes every
    rank raise (``_NotHeld``), not rank 0 alone."""
    import torch
    import torch.distributed as dist

    if not pieces:  # (every rank has the same list of tensors)
        return []
    on_rank0 = _pieces_on_rank0(pieces)
    failed = torch.zeros(1, dtype=torch.int64)  # 1 + the position of the first tensor not whole
    results: list[tuple[Any, float]] = [(None, 0.0)] * len(pieces)
    if on_rank0 is not None:
        for position, ((shape, _), ranks_pieces) in enumerate(zip(wholes, on_rank0)):
            # in the dtype of rank 0's own piece, as the pieces come back
            whole, spread = _whole_from_pieces(ranks_pieces, math.prod(shape), pieces[position][1].dtype)
            if whole is None:
                failed[0] = position + 1
                break
            results[position] = (whole.reshape(shape), spread)
    dist.broadcast(failed, src=0)  # every rank raises alike
    if failed.item():
        raise _NotHeld(int(failed.item()) - 1)
    return results


def _pieces_on_rank0(pieces: list[tuple[Any, Any]]) -> list[list[tuple[Any, Any]]] | None:
    """Per tensor, every rank's (element numbers, values) on rank 0; None on the others.
    One gather of all element numbers and one of all values (in a type every tensor's
    values convert to and back exactly), each padded to the longest rank's pieces (they
    differ: uneven shards, ranks holding none)."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    counts = torch.tensor([index.numel() for index, _ in pieces], dtype=torch.int64)
    every = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(every, counts)
    table = torch.stack(every).tolist()  # [rank][tensor]: piece lengths
    longest = max(sum(row) for row in table)
    index_dtype = functools.reduce(torch.promote_types, (index.dtype for index, _ in pieces), torch.int32)
    value_dtype = functools.reduce(torch.promote_types, (values.dtype for _, values in pieces))
    mine = sum(table[rank])
    flat_index, flat_values = torch.zeros(longest, dtype=index_dtype), torch.zeros(longest, dtype=value_dtype)
    if mine:
        torch.cat([index.to(index_dtype) for index, _ in pieces], out=flat_index[:mine])
        torch.cat([values.to(value_dtype) for _, values in pieces], out=flat_values[:mine])
    gathered = []
    for flat in (flat_index, flat_values):
        into = [torch.empty_like(flat) for _ in range(world)] if rank == 0 else None
        dist.gather(flat, into, dst=0)
        gathered.append(into)
    if rank != 0:
        return None
    out: list[list[tuple[Any, Any]]] = [[] for _ in pieces]
    for row, indices, values in zip(table, *gathered):
        for position, (length, start) in enumerate(zip(row, itertools.accumulate(row, initial=0))):
            # views, not copies (index_add_ and indexing take int32 element numbers as they are)
            piece = slice(start, start + length)
            out[position].append((indices[piece], values[piece].to(pieces[position][1].dtype)))
    return out


def _whole_from_pieces(pieces, numel: int, dtype) -> tuple[Any, float]:
    """(whole tensor, 2 x the largest distance of a copy from it) from every rank's piece:
    each element the mean of its copies; None for the whole when some element has none."""
    import torch

    values, count = torch.zeros(numel, dtype=dtype), torch.zeros(numel, dtype=dtype)
    for indices, piece in pieces:
        values.index_add_(0, indices, piece)
        count.index_add_(0, indices, torch.ones_like(piece))
    if bool((count == 0).any()):
        return None, 0.0
    whole = values / count
    spread = max(((piece - whole[indices]).abs().max().item() for indices, piece in pieces if piece.numel()),
                 default=0.0)
    return whole, 2 * spread


def local_elements(index, placements, sizes: list[int], coords: list[int]):
    """The elements of ``index`` (the whole tensor's element numbers) one rank holds under
    ``placements``: ``local_piece`` mesh dim by mesh dim, outermost first, as DTensor lays
    them out, except for FSDP2's split of what the plan already split. FSDP2 shards the
    piece a rank holds along the plan's dim and records that as a ``_StridedShard`` whose
    split factor counts the later mesh dims' pieces, which describes the piece only where
    the plan's split is a plain shard; after a packed split ([gate | up] kept per rank as
    a ``_StridedShard`` itself) the rank holds a plain shard of its packed piece, so that
    mesh dim is applied last, as a plain shard."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from hyper_parallel.distributed.applier import local_piece

    order, last = [], []
    for dim, placement in enumerate(placements):
        later = [d for d in range(dim + 1, len(placements))
                 if isinstance(placements[d], (Shard, _StridedShard)) and placements[d].dim == getattr(placement, "dim", None)]
        if (isinstance(placement, _StridedShard) and any(isinstance(placements[d], _StridedShard) for d in later)
                and placement.split_factor == math.prod(sizes[d] for d in later)):
            last.append(dim)
        else:
            order.append(dim)
    for dim in order + last:
        placement = Shard(placements[dim].dim) if dim in last else placements[dim]
        index = local_piece(index, placement, sizes[dim], coords[dim])
    return index


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


def module_outputs(model, batch, pipeline: PipelineRun | None = None) -> dict[str, Any]:
    """Each module's first output tensor as it leaves the module (after the plan's output
    conversion; DTensors gathered), in the order they were made. Modules that ran more
    often than once a micro-batch (an expert loop's activation) are left out: one output
    says little of them. Under pp, ``pipeline`` runs the batch once per micro-batch and a
    rank reports only the modules of its own stages: not what it took out, and before the
    last stage not the model or its base model (their output there is a stage's, not the
    model's)."""
    import torch

    from hyper_parallel.distributed.pipeline import STAGE_ATTRIBUTE, pruned_names

    skip = set(pruned_names(model))
    info = model.__dict__.get(STAGE_ATTRIBUTE)
    if info is not None and not info.is_last:
        skip |= {name for name, module in model.named_modules() if module is model or module is model.base_model}
    runs = pipeline.microbatches if pipeline is not None else 1
    outputs: dict[str, Any] = {}
    counts: dict[str, int] = {}
    handles = []

    def hook(name):
        def record(module, args, output):
            value = _first_tensor(output)
            if value is None:
                return
            counts[name] = counts.get(name, 0) + 1
            if name in outputs:
                return
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            outputs[name] = value.detach().clone()
        return record

    if pipeline is not None:
        with torch.no_grad():
            pipeline.forward(batch)  # the stages' first run infers their shapes: not the model's outputs
    for name, module in model.named_modules():
        if name not in skip:
            handles.append(module.register_forward_hook(hook(name)))
    with torch.no_grad():
        if pipeline is not None:
            pipeline.forward(batch)
        else:
            model(input_ids=batch, labels=batch)
    for handle in handles:
        handle.remove()
    return {name: value for name, value in outputs.items() if counts[name] == runs}


def _first_tensor(output):
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    for key in ("logits", "last_hidden_state"):
        value = getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            return value
    return None


if __name__ == "__main__":
    sys.exit(main())
