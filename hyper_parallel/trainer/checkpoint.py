"""Checkpoints of a training run (``training.checkpoint``): saved with
``torch.distributed.checkpoint`` (DCP), atomically, and loaded back for an exact resume.

A checkpoint is the folder ``<dir>/step_<N>/``:

- DCP's files: ``{"model": ..., "optim": ...}`` from ``get_state_dict`` (DTensor and
  FSDP2 shards saved as shards, each rank writing its own);
- ``rng/rank_<r>.pt``: that rank's torch CPU RNG state;
- ``hf/``: the model's HF ``config.json`` and the bundle's weight map (rank 0), which
  ``trainer export`` reads (``trainer/export.py``);
- ``COMPLETE.json``, written last by rank 0: the step, the data position, the layout.

Every rank writes into ``step_<N>.tmp-<id>/``; after all ranks finished (a barrier)
rank 0 writes the marker and renames the folder to ``step_<N>/``. A run killed during a
save leaves only a ``.tmp-`` folder (or, at worst, a folder without its marker): the
next start ignores and removes it and resumes from the newest folder with a marker.
The folder must be one every rank sees (a shared file system across nodes): at start, with
several ranks, rank 0 writes a probe file there and a rank that does not find it (a
node-local disk) fails every rank's start naming its node, rather than saving checkpoints
that hold only one node's shards (``check_shared_folder``).
"""

import dataclasses
import json
import logging
import math
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.config.schema import TrainerConfig
from hyper_parallel.distributed.local_views import PackedRows, packed_rows
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.models.hf.model_builder import recipe_model_dir
from hyper_parallel.protocols.axes import SIZE_AXES
from hyper_parallel.trainer.checkpoint_check import (
    CheckpointMismatch,
    check_loadable,
    load_failure,
    read_marker,
    read_metadata,
)
from hyper_parallel.trainer.checkpoint_layout import adapt_view, saved_tensors
from hyper_parallel.trainer.export import write_export_info

_LOG = logging.getLogger(__name__)

MARKER = "COMPLETE.json"
# The marker's format version. 2: the optimizer state is flattened to one entry per
# parameter name (``flatten_optimizer_state_dict``), so every rank, whichever pipeline
# stage's parameters it holds, saves and loads its own param-group settings.
FORMAT = 2
# DCP's state dict options: the optimizer state keyed by parameter name throughout.
STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_COMPLETE_NAME = re.compile(r"^step_(\d+)$")
_PARTIAL_NAME = re.compile(r"^step_\d+\.tmp-")


class CheckpointError(ValueError, HyperParallelError):
    """A checkpoint folder the trainer cannot use; names the recipe key."""


@dataclass
class Resumed:
    """Where a resumed run starts: the checkpoint folder, the steps already done and the
    data position the checkpoint recorded (its marker's ``data``)."""

    path: Path
    step: int
    data: dict = field(default_factory=dict)


def checkpoint_root(config: TrainerConfig, where: str) -> Path | None:
    """The recipe's ``training.checkpoint.dir`` as a path (relative paths start at the
    recipe's folder, as every recipe path does), or None when checkpoints are off.
    Checked before any rank builds a model, so a file in its place is one line."""
    folder = config.training.checkpoint.dir
    if folder is None:
        return None
    path = Path(folder)
    if not path.is_absolute():
        path = Path(config._yaml_path or where).parent / path
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{where}: training.checkpoint.dir: {path} is a file; expected a folder for the "
                              f"checkpoints (relative paths start at the recipe's folder); fix training.checkpoint.dir")
    return path


def scan(root: Path) -> tuple[list[tuple[int, Path]], list[Path]]:
    """The complete checkpoints under ``root`` (oldest first) and the partial ones: a
    ``step_<N>.tmp-*`` folder, or a ``step_<N>`` without its marker. Other entries are
    the user's and are left alone."""
    complete, partial = [], []
    if not root.is_dir():
        return complete, partial
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        match = _COMPLETE_NAME.match(entry.name)
        if match and (entry / MARKER).is_file():
            complete.append((int(match.group(1)), entry))
        elif match or _PARTIAL_NAME.match(entry.name):
            partial.append(entry)
    complete.sort(key=lambda item: item[0])
    return complete, partial


def remove_partial(root: Path) -> list[Path]:
    """Remove the partial checkpoints a killed save left (rank 0, at start): they can
    never be loaded, and a later save of the same step must not find them."""
    _, partial = scan(root)
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
        _LOG.info(f"removed partial checkpoint {path} (a save that did not finish)")
    return partial


def latest_complete(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    complete, _ = scan(root)
    return complete[-1][1] if complete else None


def prune(root: Path, keep_last: int) -> list[Path]:
    """Remove all but the ``keep_last`` newest complete checkpoints (0 keeps all)."""
    complete, _ = scan(root)
    if keep_last == 0 or len(complete) <= keep_last:
        return []
    removed = [path for _, path in complete[:-keep_last]]
    for path in removed:
        # Renamed to a partial name first: a kill during the removal leaves a folder the
        # next start cleans, never a complete-looking folder with files missing.
        doomed = path.with_name(f"{path.name}.tmp-removed-{uuid.uuid4().hex[:8]}")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        _LOG.info(f"removed checkpoint {path} (keep_last {keep_last})")
    return removed


@dataclass
class _Part:
    """One block of a ``_StridedShard`` tensor, stored under a key of its own."""

    local: torch.Tensor  # the rank's whole local tensor (the block is copied back into it on load)
    dim: int
    start: int
    length: int
    saved: DTensor  # the block as a plain ``Shard(dim)`` DTensor (a copy)


def _split_strided(key: str, tensor: DTensor) -> dict[str, _Part]:
    """A DTensor placed ``_StridedShard(dim, split_factor=s)`` (a fused gate_up or qkv
    projection split over tp: each rank holds one chunk of each of the ``s`` packed
    blocks) as ``s`` DTensors placed ``Shard(dim)``, one per block. DCP describes a shard
    by one offset per dimension, so it cannot save a rank's non-contiguous rows; each
    block's rows on a rank are contiguous. Keys: ``<key>@part<k>of<s>``."""
    placements = list(tensor.placements)
    strided = [i for i, p in enumerate(placements) if isinstance(p, _StridedShard)]
    placement = placements[strided[0]]
    dim = placement.dim
    others = [p for i, p in enumerate(placements) if i != strided[0] and isinstance(p, (Shard, _StridedShard))]
    local = tensor.to_local()
    blocks = placement.split_factor
    pieces = tensor.device_mesh.size(strided[0])
    if len(strided) > 1 or any(p.dim == dim for p in others) or tensor.shape[dim] % (blocks * pieces):
        raise CheckpointError(f"cannot checkpoint {key}: placements {tuple(tensor.placements)} over shape "
                              f"{tuple(tensor.shape)} are not supported by the checkpointer yet (one strided "
                              f"shard per dimension, dividing it evenly)")
    length = local.shape[dim] // blocks
    placements[strided[0]] = Shard(dim)
    shape = list(tensor.shape)
    shape[dim] //= blocks
    parts = {}
    for k in range(blocks):
        block = local.narrow(dim, k * length, length).detach().clone(memory_format=torch.contiguous_format)
        saved = DTensor.from_local(block, tensor.device_mesh, placements, run_check=False,
                                   shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
        parts[f"{key}@part{k}of{blocks}"] = _Part(local, dim, k * length, length, saved)
    return parts


def _split_packed(key: str, tensor: DTensor, rows: PackedRows) -> dict[str, _Part]:
    """A parameter (or its optimizer state) stored in packed order over tp (blocks of
    unequal sizes, ``local_views.PackedRows``) as one ``Shard(dim)`` DTensor per block,
    in the model's order: the checkpoint then holds the blocks as the model has them,
    whatever the tp size, and joined they are the model's tensor (export). Keys:
    ``<key>@part<k>of<s>``, as a strided tensor's blocks (the saved shapes tell their sizes)."""
    local = tensor.to_local()
    shape = list(tensor.shape)
    parts = {}
    for k, ((start, length), size) in enumerate(zip(rows.local_blocks(), rows.sizes)):
        block = local.narrow(rows.dim, start, length).detach().clone(memory_format=torch.contiguous_format)
        shape[rows.dim] = size
        saved = DTensor.from_local(block, tensor.device_mesh, tensor.placements, run_check=False,
                                   shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
        parts[f"{key}@part{k}of{len(rows.sizes)}"] = _Part(local, rows.dim, start, length, saved)
    return parts


def _packed_state(key: str, value, packed: dict[str, PackedRows]) -> PackedRows | None:
    """The packed order of a state entry: a parameter (``model.<name>``) or one of its
    optimizer states (``optim.state.<name>.<stat>``, flattened), stored as the parameter is."""
    if not packed or not isinstance(value, DTensor):
        return None
    if key.startswith("model."):
        rows = packed.get(key[len("model."):])
    elif key.startswith("optim.state."):
        rows = packed.get(key[len("optim.state."):].rpartition(".")[0])
    else:
        return None
    if rows is None or value.dim() <= rows.dim or value.shape[rows.dim] != sum(rows.sizes):
        return None  # a scalar state (AdamW's step) or another shape: stored as it is
    return rows


def _contiguous_strided(tensor: DTensor) -> bool:
    """Whether the tensor's one ``_StridedShard`` is FSDP2's over a plain ``Shard`` of the
    same dimension on later mesh dims (dp over a tp-sharded embedding or projection):
    its split factor is their ranks' count, so each rank's rows are one contiguous range
    of the global tensor, which DCP saves and reshards as it is."""
    placements = list(tensor.placements)
    strided = [i for i, p in enumerate(placements) if isinstance(p, _StridedShard)]
    if len(strided) != 1:
        return False
    first = strided[0]
    dim, factor = placements[first].dim, placements[first].split_factor
    later = [j for j in range(first + 1, len(placements))
             if isinstance(placements[j], Shard) and not isinstance(placements[j], _StridedShard)
             and placements[j].dim == dim]
    return factor == math.prod(tensor.device_mesh.size(j) for j in later) and factor > 1


def _dcp_view(state: dict, prefix: str = "", packed: dict[str, PackedRows] | None = None
              ) -> tuple[dict, list[_Part]]:
    """``state`` as DCP saves it: the same nesting and tensors, with each strided-shard
    DTensor and each tensor stored in packed order (``packed``: the model's, by parameter
    name) replaced by its blocks (``_split_strided``, ``_split_packed``). Returns the view
    and the blocks, which ``_restore_parts`` copies back after a load."""
    view, parts = {}, []
    for name, value in state.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            view[name], inner = _dcp_view(value, f"{key}.", packed)
            parts.extend(inner)
        elif (rows := _packed_state(key, value, packed or {})) is not None:
            for part_key, part in _split_packed(key, value, rows).items():
                view[part_key[len(prefix):]] = part.saved
                parts.append(part)
        elif isinstance(value, DTensor) and any(isinstance(p, _StridedShard) for p in value.placements) \
                and not _contiguous_strided(value):
            for part_key, part in _split_strided(key, value).items():
                view[part_key[len(prefix):]] = part.saved
                parts.append(part)
        else:
            view[name] = value
    return view, parts


@torch.no_grad()
def _restore_parts(parts: list[_Part]) -> None:
    """Copy loaded blocks back into their rank's local tensor."""
    for part in parts:
        part.local.narrow(part.dim, part.start, part.length).copy_(part.saved.to_local())


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (POSIX); a no-op where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(folder: Path, record: dict) -> None:
    """The completion marker, written whole (temp file, fsync, rename): its presence
    means every rank's files are in ``folder``."""
    part = folder / (MARKER + ".part")
    with open(part, "w") as handle:
        handle.write(json.dumps(record, indent=1, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(part, folder / MARKER)


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished ``step_<N>.tmp-<id>`` to ``step_<N>``; an older folder of the
    same step (a run started with resume off) is moved aside and removed first."""
    if final.exists():
        aside = final.with_name(f"{final.name}.tmp-replaced-{uuid.uuid4().hex[:8]}")
        os.replace(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


SHARED_PROBE_WAIT_S = 10.0  # a network filesystem may show another client's new file after its attribute cache


def check_shared_folder(root: Path, where: str) -> None:
    """Every rank sees ``root`` as rank 0 does: rank 0 writes a probe file with a fresh token,
    every rank looks for it (up to ``SHARED_PROBE_WAIT_S``), the verdicts are gathered. DCP
    writes each rank's shards where that rank stands and rank 0 publishes the folder, so on
    node-local disks every save would be one node's shards only and every resume would fail;
    that is refused at start, naming the ranks and nodes that do not share the folder."""
    from hyper_parallel.distributed.ranks import node_of_this_rank

    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    probe = root / f".shared-probe-{token[0]}"
    written = [""]
    if dist.get_rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe.write_text(token[0])
        except OSError as exc:
            written = [f"rank 0 cannot write there ({exc.strerror or exc})"]
    dist.broadcast_object_list(written, src=0)  # rank 0's failure: nobody waits for a probe that is not there
    if written[0]:
        raise CheckpointError(f"{where}: training.checkpoint.dir: {root}: {written[0]}; fix training.checkpoint.dir "
                              f"(relative paths start at the recipe's folder)")
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, (_sees(probe, token[0]), node_of_this_rank()))
    if dist.get_rank() == 0:
        try:
            probe.unlink()
        except OSError:
            pass
    blind = [rank for rank, (ok, _) in enumerate(found) if not ok]
    if blind:
        nodes = sorted({found[rank][1] for rank in blind})
        problem = (f"rank(s) {blind} ({', '.join(nodes)}) do not find the file rank 0 wrote there within "
                   f"{SHARED_PROBE_WAIT_S:.0f}s: their folder is another disk")
        raise CheckpointError(f"{where}: training.checkpoint.dir: {root} is not one folder every rank sees: {problem}. "
                              f"Every rank writes its shards into a checkpoint and reads them back on resume, so "
                              f"the folder must be shared by every node (NFS, Lustre, a mounted bucket); fix: point "
                              f"training.checkpoint.dir at such a folder, or remove it (no checkpoints)")


def _sees(probe: Path, token: str) -> bool:
    """The probe file holds the token, now or within ``SHARED_PROBE_WAIT_S``."""
    deadline = time.monotonic() + SHARED_PROBE_WAIT_S
    while True:
        try:
            if probe.read_text() == token:
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


class Checkpointer:
    """Saves and loads one run's checkpoints; every rank holds one and calls it at the
    same points (its methods run collectives)."""

    def __init__(self, config: TrainerConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 where: str):
        self.settings = config.training.checkpoint
        self.config = config
        self.model, self.optimizer = model, optimizer
        self.root = checkpoint_root(config, where)
        self.where = where
        # Set by the trainer: after ``step`` steps, the data position to record besides
        # the step (trainer/corpus.py: the rows consumed and the corpus fingerprint).
        self.data_state: Callable[[int], dict] | None = None
        self.rank = dist.get_rank()
        if self.root is not None and dist.get_world_size() > 1:
            check_shared_folder(self.root, where)
        # An async save runs its collectives in a background thread; on a group of its own
        # they never interleave with the training step's collectives on the default group.
        self._async_group = dist.new_group(backend="gloo") if self.root and self.settings.async_ else None
        self._pending = None  # (future, tmp, final, record) of an async save not yet published

    @property
    def enabled(self) -> bool:
        return self.root is not None

    def _state(self) -> dict:
        """Model and optimizer state as DCP saves and loads it: sharded (DTensor/FSDP2
        shards stay on their ranks), named by the model's own parameter names."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=STATE_OPTIONS)
        return {"model": model_state, "optim": optim_state}

    def resume(self, wanted: bool) -> Resumed | None:
        """At start: rank 0 removes partial checkpoints and picks the newest complete one;
        when ``wanted``, every rank loads it. Returns where the run resumes, or None."""
        if not self.enabled:
            return None
        choice = [None]
        if self.rank == 0:
            remove_partial(self.root)
            latest = latest_complete(self.root) if wanted else None
            choice = [str(latest) if latest else None]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        path = Path(choice[0])
        state = self._state()
        view, parts = _dcp_view(state, packed=packed_rows(self.model))
        try:  # another model's or a damaged checkpoint: one line naming the tensor or file
            record = read_marker(path / MARKER, self.where)
            if record.get("format") != FORMAT:
                raise CheckpointMismatch(f"{self.where}: training.checkpoint.dir: checkpoint {path} has format "
                                         f"{record.get('format')!r}, this version reads {FORMAT} (its optimizer "
                                         f"state is kept in another form); fix: train on with --no-resume, or point "
                                         f"training.checkpoint.dir at a new folder")
            read_metadata(path, self.where)  # a missing or unreadable .metadata, named
            # saved at another layout: packed tensors may be held as blocks here and whole there
            view, restores = adapt_view(view, parts, saved_tensors(path))
            check_loadable(path, view, self.where)
        except CheckpointMismatch as exc:
            raise CheckpointError(str(exc)) from None
        try:
            dcp.load(view, checkpoint_id=str(path))
        except CheckpointException as exc:  # raised on every rank alike: DCP gathers the failures
            raise CheckpointError(str(load_failure(path, exc, self.where))) from None
        _restore_parts(parts)
        for restore in restores:
            restore.run()
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=STATE_OPTIONS)
        rng = path / "rng" / f"rank_{self.rank}.pt"
        if rng.is_file():
            torch.set_rng_state(torch.load(rng, weights_only=True))
        if self.rank == 0:
            _LOG.info(f"resumed from checkpoint {path} (step {record['step']})")
        return Resumed(path, int(record["step"]), record.get("data") or {})

    def maybe_save(self, step: int, last: bool) -> None:
        """After ``step`` steps: save when ``every_steps`` divides it, or after the last step."""
        if self.enabled and (step % self.settings.every_steps == 0 or last):
            self.save(step)

    def save(self, step: int) -> None:
        """Save the state after ``step`` steps into ``step_<step>/``, atomically."""
        self.finish()  # an earlier async save is published first: checkpoints appear in step order
        token = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        final = self.root / f"step_{step}"
        tmp = self.root / f"step_{step}.tmp-{token[0]}"
        (tmp / "rng").mkdir(parents=True, exist_ok=True)
        torch.save(torch.get_rng_state(), tmp / "rng" / f"rank_{self.rank}.pt")
        if self.rank == 0:
            # the HF config, weight map, tokenizer and generation config `export` needs
            write_export_info(tmp, self.model, recipe_model_dir(self.config))
        dims = self.config.accelerator
        record = {
            "format": FORMAT,
            "step": step,
            # Synthetic and bytes batches are a function of the step index (trainer/data.py
            # global_batch): the next step's batch is where the data resumes. Tokenized
            # datasets add their row position (trainer/corpus.py, through data_state).
            "data": {"kind": self.config.dataset.kind, "next_step": step,
                     **(self.data_state(step) if self.data_state else {})},
            # The rate is a function of the step (trainer/schedule.py): the step above and
            # these settings are its whole state; a resumed run recomputes it.
            "lr_schedule": {"lr": self.config.optimizer.lr, **dataclasses.asdict(self.config.training.lr_schedule)},
            "world_size": dist.get_world_size(),
            "layout": {k: getattr(dims, f"{k}_size") for k in SIZE_AXES},
        }
        if self.settings.async_:
            view, _ = _dcp_view(self._state(), packed=packed_rows(self.model))
            future = dcp.async_save(view, checkpoint_id=str(tmp), process_group=self._async_group)
            self._pending = (future, tmp, final, record)
            return
        view, _ = _dcp_view(self._state(), packed=packed_rows(self.model))
        dcp.save(view, checkpoint_id=str(tmp))
        self._publish(tmp, final, record)

    def finish(self) -> None:
        """Wait for an async save in flight and publish it (before the next save, and at
        the end of training)."""
        if self._pending is None:
            return
        future, tmp, final, record = self._pending
        self._pending = None
        future.result()
        self._publish(tmp, final, record)

    def _publish(self, tmp: Path, final: Path, record: dict) -> None:
        """After every rank wrote its part: rank 0 marks the folder complete, renames it
        into place and prunes old checkpoints; the others wait for it."""
        dist.barrier()
        if self.rank == 0:
            _write_marker(tmp, record)
            _publish(tmp, final)
            _LOG.info(f"saved checkpoint {final}")
            prune(self.root, self.settings.keep_last)
        dist.barrier()
