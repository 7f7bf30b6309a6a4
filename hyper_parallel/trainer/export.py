"""HF export of a training checkpoint: ``config.json`` and safetensors under the names
``save_pretrained`` writes, so ``AutoModelForCausalLM.from_pretrained`` loads the trained
weights.

    python -m hyper_parallel.trainer export --checkpoint DIR/step_N --out HF_DIR
    python -m torch.distributed.run --nproc_per_node=R -m hyper_parallel.trainer export ...

A checkpoint folder carries what export needs (written by rank 0 at save, ``hf/``): the
model's HF ``config.json`` and, for a generated bundle, its recorded weight map (else
the map is derived from the config on a meta model, the same way codegen derives it).
The weight map says which part of which trained tensor each HF tensor is; export reads
the trained tensors from the DCP files one at a time (blocks of a packed tensor joined),
cuts the HF tensors out of them, and streams them one by one into files of about
``max_shard_bytes`` (``safetensors_stream``: a rank holds one output tensor, not a file).
Under torchrun each rank exports every R-th HF tensor and writes its own files; rank 0
writes ``model.safetensors.index.json`` last. No rank ever holds the whole model.
"""

import itertools
import json
import logging
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hyper_parallel.distributed.weight_map import Rule, WeightMapError, compile_pattern, parse_rule
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.trainer.safetensors_stream import StreamedSafetensors

_LOG = logging.getLogger(__name__)

EXPORT_INFO = "hf"  # inside a checkpoint folder
WEIGHT_MAP_FILE = "weight_map.json"
MAX_SHARD_BYTES = 2 << 30
_PART = re.compile(r"^(?P<key>.+)@part(?P<k>\d+)of(?P<s>\d+)$")


class ExportError(ValueError, HyperParallelError):
    """A checkpoint that cannot be exported; names the folder and the tensor."""


# Files of the model folder a checkpoint carries for `export`, so the exported folder is one
# transformers' pipeline("text-generation", ...) loads (tokenizer, generation defaults).
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "generation_config.json")


def write_export_info(folder: Path, model: torch.nn.Module, source: Path | None = None) -> None:
    """At save (rank 0): the model's HF config, its recorded weight map, if it has them (a
    custom-backend model carries the HF config it was built from, and the map from the HF
    layout to its own names), the model folder's tokenizer files (``source``) and its
    generation config (made from the model's config where the folder has none)."""
    config = getattr(model, "hyper_hf_config", None) or getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_json_file", None)):
        return
    info = folder / EXPORT_INFO
    info.mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(info / "config.json"), use_diff=False)
    recorded = getattr(model, "hyper_weight_map", None)
    if recorded:
        (info / WEIGHT_MAP_FILE).write_text(json.dumps(recorded, indent=1) + "\n")
    for name in SIDE_FILES:
        if source is not None and (source / name).is_file():
            shutil.copyfile(source / name, info / name)
    if not (info / "generation_config.json").is_file():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(config).to_json_file(str(info / "generation_config.json"))


def _weight_map(checkpoint: Path) -> dict:
    """The recorded map, or the one transformers' conversion gives the config's model."""
    path = checkpoint / EXPORT_INFO / WEIGHT_MAP_FILE
    if path.is_file():
        return json.loads(path.read_text())
    from transformers import AutoConfig, AutoModelForCausalLM

    from hyper_parallel.distributed.weight_map import weight_map_text

    config = AutoConfig.from_pretrained(str(checkpoint / EXPORT_INFO))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return weight_map_text(model)


def _trained_tensors(checkpoint: Path) -> dict[str, tuple[torch.Size, torch.dtype, list[str]]]:
    """Model tensor name → (shape of one saved piece, dtype, its DCP keys: the name's own,
    or its blocks in order)."""
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    out: dict[str, tuple] = {}
    for key, md in sorted(metadata.items()):
        if not key.startswith("model.") or not isinstance(md, TensorStorageMetadata):
            continue
        found = _PART.match(key)
        name = (found["key"] if found else key)[len("model."):]
        shape, dtype, keys = out.get(name, (md.size, md.properties.dtype, []))
        out[name] = (shape, dtype, keys + [key])
    for _, _, keys in out.values():  # blocks in order (``@part10of12`` after ``@part9of12``)
        keys.sort(key=lambda k: int(found["k"]) if (found := _PART.match(k)) else 0)
    return out


def hf_rules(recorded: dict, trained: dict[str, tuple]) -> dict[str, list[Rule]]:
    """HF tensor name → its rules, the map's patterns expanded over the trained tensors:
    a name ``*`` takes the trained names' indices, a stacking ``*`` every position."""
    out: dict[str, list[Rule]] = {}
    for key, value in recorded.items():
        texts = [value] if isinstance(value, str) else list(value)
        if "*" not in key:
            out[key] = [parse_rule(text) for text in texts]
            continue
        for values in _bindings(texts[0], trained):
            concrete = _fill(key, values)
            out[concrete] = [parse_rule(_fill(text, values)) for text in texts]
    return out


def _bindings(text: str, trained: dict[str, tuple]) -> list[list[str]]:
    """Every assignment of the rule's ``*`` that names a trained tensor and a position in it."""
    target, _, _ = text.partition(" = ")
    name, bracket, index = target.partition("[")
    pattern = compile_pattern(name)
    out = []
    for trained_name, (shape, _, _) in trained.items():
        found = pattern.match(trained_name)
        if not found:
            continue
        items = [item.strip() for item in index.rstrip("]").split(",")] if bracket else []
        stacked = [shape[d] for d, item in enumerate(items) if item == "*"]
        for positions in itertools.product(*[range(size) for size in stacked]):
            out.append([*found.groups(), *map(str, positions)])
    return out


def _fill(text: str, values: list[str]) -> str:
    """``text`` with its ``*`` replaced by ``values`` in order."""
    pieces = text.split("*")
    return "".join(piece + value for piece, value in zip(pieces, values)) + pieces[-1]


class _MetadataOnce(dcp.FileSystemReader):
    """A DCP reader that unpickles the checkpoint's metadata once: export loads tensor by
    tensor, and each ``dcp.load`` would read the whole metadata file again."""

    def __init__(self, path: str):
        super().__init__(path)
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class _Reader:
    """Trained tensors read from the DCP files one at a time, the last one kept (the HF
    tensors cut from one trained tensor are cut one after another)."""

    def __init__(self, checkpoint: Path, trained: dict[str, tuple], by_target: dict[str, list[Rule]]):
        self.checkpoint, self.trained, self.by_target = checkpoint, trained, by_target
        self.storage = _MetadataOnce(str(checkpoint))
        self.name, self.tensor = None, None

    def get(self, name: str) -> torch.Tensor:
        """Trained tensor ``name`` (its blocks joined)."""
        if name != self.name:
            self.name, self.tensor = name, None
            self.tensor = self._read(name)
        return self.tensor

    def _read(self, name: str) -> torch.Tensor:
        """Each saved piece loaded alone (``no_dist``: this rank's own read), blocks joined."""
        if name not in self.trained:
            raise ExportError(f"{self.checkpoint}: the weight map names {name}, which the checkpoint lacks")
        shape, dtype, keys = self.trained[name]
        saved = self.storage.read_metadata().state_dict_metadata
        pieces = []
        for key in keys:
            piece = torch.empty(saved[key].size, dtype=dtype)
            with warnings.catch_warnings():  # one process reading on purpose: no_dist says so
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({key: piece}, storage_reader=self.storage, no_dist=True)
            pieces.append(piece)
        if len(pieces) == 1:
            return pieces[0]
        # blocks of unequal sizes (local_views.PackedRows) differ along the dim they join on
        unequal = [d for d in range(len(shape)) if len({piece.shape[d] for piece in pieces}) > 1]
        dim = unequal[0] if len(unequal) == 1 else _packed_dim(name, shape, len(pieces), self.by_target[name])
        return torch.cat(pieces, dim=dim)


def _packed_dim(name: str, block: torch.Size, count: int, rules: list[Rule]) -> int:
    """The dimension a packed tensor's blocks join along: where the weight map's boxes
    for it reach ``count`` times the block's size."""
    for d, size in enumerate(block):
        ends = [r.index[d] + 1 if isinstance(r.index[d], int) else r.index[d][1]
                for r in rules if d < len(r.index) and r.index[d] is not None]
        if ends and max(ends) == size * count:
            return d
    raise ExportError(f"{name}: saved as {count} blocks of {tuple(block)}; the weight map does not say along "
                      f"which dimension they join")


def _region(tensor: torch.Tensor, rule: Rule) -> torch.Tensor:
    """``tensor[rule.index]`` in the checkpoint tensor's dimension order."""
    if rule.ops is not None:
        raise ExportError(f"{rule.target}: transformers' conversion ({rule.ops}) moves data in a way export does "
                          f"not reverse yet")
    region = tensor
    for d in reversed(range(len(rule.index))):
        place = rule.index[d]
        if isinstance(place, int):
            region = region.select(d, place)
        elif place is not None:
            region = region.narrow(d, place[0], place[1] - place[0])
    if rule.axes is not None:  # the region's dims are the checkpoint's in ``axes`` order
        region = region.permute(*[rule.axes.index(i) for i in range(len(rule.axes))])
    return region


def _assemble(pieces: list[tuple[Rule, torch.Tensor]]) -> torch.Tensor:
    """One HF tensor from its regions, each at its slice (the whole tensor when unsliced)."""
    sizes = None
    for rule, region in pieces:
        source = list(rule.source) + [None] * (region.dim() - len(rule.source))
        extent = [region.shape[d] if r is None else r[1] for d, r in enumerate(source)]
        sizes = extent if sizes is None else [max(a, b) for a, b in zip(sizes, extent)]
    out = pieces[0][1].new_empty(sizes)
    for rule, region in pieces:
        source = list(rule.source) + [None] * (region.dim() - len(rule.source))
        out[tuple(slice(None) if r is None else slice(*r) for r in source)] = region
    return out


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Write this rank's safetensors files (every rank), then rank 0 ``config.json`` and
    the index. HF tensors are dealt to ranks by the trained tensor they are cut from, so
    each rank reads each trained tensor it needs once. Returns the files this rank wrote."""
    checkpoint, out = Path(checkpoint), Path(out)
    if not (checkpoint / EXPORT_INFO / "config.json").is_file():
        raise ExportError(f"{checkpoint}: no {EXPORT_INFO}/config.json (a checkpoint saved before export existed, "
                          f"or by the custom backend); nothing to export")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    trained = _trained_tensors(checkpoint)
    try:
        rules = hf_rules(_weight_map(checkpoint), trained)
    except WeightMapError as exc:
        raise ExportError(f"{checkpoint}: {exc}") from None
    by_target: dict[str, list[Rule]] = {}
    for key_rules in rules.values():
        for rule in key_rules:
            by_target.setdefault(rule.target, []).append(rule)
    targets = sorted({key_rules[0].target for key_rules in rules.values()})
    mine = set(targets[rank::world])
    out.mkdir(parents=True, exist_ok=True)
    reader = _Reader(checkpoint, trained, by_target)
    written: list[Path] = []
    index: dict[str, str] = {}
    total, file = 0, None
    for key in sorted((k for k in rules if rules[k][0].target in mine), key=lambda k: (rules[k][0].target, k)):
        if file is None:
            file = StreamedSafetensors(out / f"model-rank{rank:03d}-{len(written):05d}.safetensors", {"format": "pt"})
        # one HF tensor at a time, streamed into its file: a rank holds one tensor of output
        tensor = _assemble([(rule, _region(reader.get(rule.target), rule)) for rule in rules[key]])
        file.add(key, tensor)
        index[key] = file.path.name
        total += tensor.nbytes
        del tensor
        if file.nbytes >= max_shard_bytes:
            written.append(file.close())
            file = None
    if file is not None:
        written.append(file.close())
    _write_index(out, checkpoint, index, total, rank, world)
    return written


def _write_index(out: Path, checkpoint: Path, index: dict[str, str], total: int, rank: int, world: int) -> None:
    """Every rank's part of the index gathered on rank 0, which writes it and config.json."""
    parts = [None] * world
    if world > 1:
        dist.all_gather_object(parts, (index, total))
    else:
        parts = [(index, total)]
    if rank != 0:
        return
    weight_map = {key: file for part, _ in parts for key, file in part.items()}
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t for _, t in parts)}, "weight_map": dict(sorted(weight_map.items()))},
        indent=1) + "\n")
    for side in sorted((checkpoint / EXPORT_INFO).iterdir()):  # config.json, tokenizer, generation config
        if side.is_file() and side.name != WEIGHT_MAP_FILE:
            shutil.copyfile(side, out / side.name)
    _LOG.info(f"exported {checkpoint} to {out}: {len(weight_map)} tensors")


def export_main(argv: list[str]) -> int:
    """``python -m hyper_parallel.trainer export --checkpoint DIR --out HF_DIR``, alone or
    under torchrun (every rank writes its share)."""
    import argparse
    import os
    import sys

    parser = argparse.ArgumentParser(prog="python -m hyper_parallel.trainer export",
                                     description="Write a training checkpoint as an HF model folder "
                                                 "(config.json + safetensors with transformers' names).")
    parser.add_argument("--checkpoint", required=True, help="a checkpoint folder (<training.checkpoint.dir>/step_N)")
    parser.add_argument("--out", required=True, help="the HF model folder to write")
    parser.add_argument("--max-shard-bytes", type=int, default=MAX_SHARD_BYTES,
                        help="start a new safetensors file past this many bytes (per rank)")
    args = parser.parse_args(argv)
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    try:
        export_checkpoint(args.checkpoint, args.out, max_shard_bytes=args.max_shard_bytes)
    except ExportError as exc:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0
