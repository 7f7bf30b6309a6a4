"""Checks a checkpoint folder before it is loaded: that it is this recipe's (every tensor
the model and optimizer hold is there, with the same global shape) and that its files are
whole (the marker and the metadata read, every shard file the metadata names exists and is
long enough, every rank's RNG state loads).

DCP itself would fail deep inside ``dcp.load`` with a per-rank traceback (or, for a
truncated file, an unpickling error naming no file). Here the first problem is one line:
the tensor with both shapes, or the file. The checks only read; the folder is left as it
is. Every rank runs them on the same files and the same global shapes, so every rank
reaches the same verdict without a collective.
"""

import io
import json
import logging
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from hyper_parallel.errors import HyperParallelError

_LOG = logging.getLogger(__name__)

KEY = "training.checkpoint.dir"
FIX = (f"fix: point {KEY} at a folder of this recipe's checkpoints (or move this checkpoint away); "
       f"nothing was changed")


class CheckpointMismatch(ValueError, HyperParallelError):
    """A checkpoint that does not fit the recipe or is damaged; one line naming the
    tensor or the file. (Caught with the trainer's other ``CheckpointError``s: it is
    re-raised as one by ``Checkpointer.resume``.)"""


def _shape(shape) -> str:
    """A shape as people write it: ``(256, 64)``."""
    return str(tuple(int(n) for n in shape))


def read_marker(file: Path, where: str) -> dict:
    """A checkpoint's completion marker (``COMPLETE.json``); an unreadable one is named
    (it was written whole, by a rename, so damage came from outside)."""
    try:
        record = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointMismatch(f"{where}: {KEY}: checkpoint file {file} cannot be read ({type(exc).__name__}: "
                                 f"{str(exc)[:200]}; the checkpoint is damaged); {FIX}") from None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise CheckpointMismatch(f"{where}: {KEY}: checkpoint file {file} holds no step (the checkpoint is damaged); "
                                 f"{FIX}")
    return record


def read_metadata(folder: Path, where: str) -> Metadata:
    """DCP's ``.metadata`` of ``folder``; a missing or unreadable one is named."""
    file = folder / ".metadata"
    if not file.is_file():
        raise CheckpointMismatch(f"{where}: {KEY}: checkpoint {folder} has no {file.name} file ({file} is missing: "
                                 f"the checkpoint is damaged); {FIX}")
    try:
        return FileSystemReader(str(folder)).read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, ValueError, TypeError) as exc:
        raise CheckpointMismatch(f"{where}: {KEY}: checkpoint file {file} cannot be read ({type(exc).__name__}: "
                                 f"{str(exc)[:200]}; the checkpoint is damaged); {FIX}") from None


def check_shapes(state: dict, metadata: Metadata, folder: Path, where: str) -> None:
    """Every tensor of ``state`` (the nested dict DCP loads into) is in the checkpoint with
    the same global shape; the first one that is not is named with both shapes."""
    flat, _ = flatten_state_dict(state)
    saved = metadata.state_dict_metadata
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        found = saved.get(key)
        if found is None:
            raise CheckpointMismatch(f"{where}: {KEY}: checkpoint {folder} does not fit this recipe: tensor {key} "
                                     f"(shape {_shape(value.shape)} here) is not in the checkpoint (a checkpoint "
                                     f"of another model or config); {FIX}")
        if not isinstance(found, TensorStorageMetadata) or tuple(found.size) != tuple(value.shape):
            what = _shape(found.size) if isinstance(found, TensorStorageMetadata) else "no tensor"
            raise CheckpointMismatch(f"{where}: {KEY}: checkpoint {folder} does not fit this recipe: tensor {key} "
                                     f"expected shape {_shape(value.shape)}, found {what} in the checkpoint (a "
                                     f"checkpoint of another model or config); {FIX}")


def check_files(metadata: Metadata, folder: Path, where: str) -> None:
    """Every shard file the metadata points into exists and holds the bytes it points at;
    the first missing or short one is named."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name in sorted(needed):
        file = folder / name
        if not file.is_file():
            raise CheckpointMismatch(f"{where}: {KEY}: checkpoint shard file {file} is missing (the checkpoint is "
                                     f"damaged); {FIX}")
        size = file.stat().st_size
        if size < needed[name]:
            raise CheckpointMismatch(f"{where}: {KEY}: checkpoint shard file {file} is truncated ({size} bytes, "
                                     f"the checkpoint's metadata needs {needed[name]}; the checkpoint is damaged); "
                                     f"{FIX}")


def check_rng_files(folder: Path, where: str) -> None:
    """Every rank's saved RNG state loads: each rank reads only its own after the model is
    loaded, so a damaged one would fail one rank alone and leave the others waiting; here
    every rank checks them all (a few bytes each) and all refuse alike."""
    for file in sorted((folder / "rng").glob("rank_*.pt")):
        try:
            state = torch.load(file, weights_only=True)
        except Exception as exc:  # noqa: BLE001 -- whatever torch.load says, the file is damaged
            state = exc
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
            raise CheckpointMismatch(f"{where}: {KEY}: checkpoint file {file} is corrupt (no RNG state: "
                                     f"{type(state).__name__}); {FIX}")


def check_loadable(folder: Path, state: dict, where: str) -> None:
    """All of the above, before ``dcp.load`` touches the model."""
    metadata = read_metadata(folder, where)
    check_shapes(state, metadata, folder, where)
    check_files(metadata, folder, where)
    check_rng_files(folder, where)


def load_failure(folder: Path, exc: Exception, where: str) -> CheckpointMismatch:
    """``dcp.load`` failed although the checks above passed (a shard file damaged in place:
    same size, other bytes). DCP's error carries every rank's traceback but no file name;
    here each stored tensor is read back on its own, and the first that does not load
    names its file. Only on failure, so the extra reads cost nothing in a good run."""
    cause = _message_line(exc)
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
        items = sorted(metadata.storage_data.items(), key=lambda item: (item[1].relative_path, item[1].offset))
        for index, info in items:
            if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                continue  # stored as raw bytes: nothing to check them against
            with open(folder / info.relative_path, "rb") as handle:
                handle.seek(info.offset)
                data = handle.read(info.length)
            try:
                torch.load(io.BytesIO(data), weights_only=True)
            except Exception as error:  # noqa: BLE001 -- any failure to read the item is the file's
                return CheckpointMismatch(f"{where}: {KEY}: checkpoint shard file {folder / info.relative_path} "
                                          f"is corrupt (its tensor {index.fqn} does not load: {type(error).__name__}); {FIX}")
    except OSError as error:
        cause = f"{cause}; {error}"
    return CheckpointMismatch(f"{where}: {KEY}: checkpoint {folder} cannot be loaded ({cause}); {FIX}")


def _message_line(exc: Exception) -> str:
    """The last line of DCP's error, shortened: its message is every failed rank's
    traceback, the innermost error at the end."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    line = lines[-1] if lines else type(exc).__name__
    return line.split("]: ", 1)[-1][:300]
