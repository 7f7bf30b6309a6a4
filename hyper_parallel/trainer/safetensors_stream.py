"""A safetensors file written one tensor at a time, so an export holds one tensor, not a file.

``safetensors.torch.save_file`` takes a dict of every tensor of the file: exporting a
2 GiB file that way holds 2 GiB of output at once, more than a rank's share of a model of
a few GB. The format is simple enough to stream: an 8-byte little-endian header length,
a JSON header (``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets"}}``,
padded with spaces to 8 bytes) and the tensors' bytes in header order. The bytes are
appended to a spill file as the tensors come; ``close`` writes the header and copies the
spill behind it into ``path`` (through a temporary name, so a reader never sees half a
file).
"""

import json
import os
import shutil
import struct
from pathlib import Path

import torch

from hyper_parallel.errors import HyperParallelError

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_COPY_CHUNK = 16 << 20


class SafetensorsStreamError(ValueError, HyperParallelError):
    """A tensor the file being written cannot take; names the file and the tensor."""


class StreamedSafetensors:
    """``add`` tensors one by one, then ``close``; ``nbytes`` is the data written so far."""

    def __init__(self, path: Path, metadata: dict[str, str]):
        self.path, self.metadata = Path(path), dict(metadata)
        self.spill = self.path.with_name(self.path.name + ".spill")
        self._handle = open(self.spill, "wb")
        self._entries: dict[str, dict] = {}
        self.nbytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._entries:
            raise SafetensorsStreamError(f"{self.path}: tensor {name} added twice")
        if tensor.dtype not in _DTYPES:
            raise SafetensorsStreamError(f"{self.path}: tensor {name} has dtype {tensor.dtype}, which safetensors does not store")
        data = tensor.detach().to("cpu").contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b""
        self._handle.write(memoryview(raw))
        size = data.numel() * data.element_size()
        self._entries[name] = {"dtype": _DTYPES[data.dtype], "shape": list(data.shape),
                               "data_offsets": [self.nbytes, self.nbytes + size]}
        self.nbytes += size

    def close(self) -> Path:
        """Write the file (header, then the spilled bytes) and remove the spill."""
        self._handle.close()
        header = json.dumps({"__metadata__": self.metadata, **self._entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        partial = self.path.with_name(self.path.name + ".tmp")
        with open(partial, "wb") as out, open(self.spill, "rb") as spilled:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            shutil.copyfileobj(spilled, out, _COPY_CHUNK)
        os.replace(partial, self.path)
        self.spill.unlink()
        return self.path
