"""The run device: chosen once from ``accelerator.device_type``, and the one door to what
differs between CPU, CUDA and Ascend NPU.

A training run makes every tensor of a step (batches, loss totals, the gradient norm, eval
sums, memory peaks, pipeline losses) on ``RunDevice.device``: nccl and hccl have no CPU
tensors, and a host round trip per tensor stalls the device. The process group gets one
backend per device type (``cpu:gloo,cuda:nccl``), so host objects (bundle bytes, verdicts)
still travel over gloo while the step's tensors go over the accelerator's backend.

What differs on Ascend lives here and nowhere else: ``torch_npu`` is imported only when a
recipe asks for ``npu`` (it registers the device and hccl), its device module is
``torch_npu.npu`` (``set_device``, ``is_available``, ``max_memory_allocated``), and hccl
reduces no float64 (``REDUCE_DTYPE``). A recipe whose device is absent is refused
(``DeviceUnavailableError``, exit 2 at the trainer's start) unless the run is told by name
to use the CPU instead (``FALLBACK_ENV=cpu``, what the CPU test suite sets for recipes
written for an accelerator). Codegen and verify never ask: they plan and prove on the CPU.
"""

import importlib
import os
import resource
from dataclasses import dataclass
from types import ModuleType

import torch

from hyper_parallel.errors import HyperParallelError

DEVICE_TYPES = ("cpu", "cuda", "npu")
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
FALLBACK_ENV = "HYPER_PARALLEL_DEVICE_FALLBACK"  # "cpu": train an accelerator's recipe on the CPU (tests)
# Sums that cross ranks (loss totals, the squared gradient norm): hccl reduces no float64.
REDUCE_DTYPE = torch.float32


class DeviceUnavailableError(RuntimeError, HyperParallelError):
    """The recipe's ``accelerator.device_type`` is not present on this machine."""


@dataclass(frozen=True)
class RunDevice:
    """Where this rank's run computes: ``type`` (cpu, cuda or npu), the local ``index``
    (LOCAL_RANK on an accelerator, None on the CPU) and the recipe's ``requested`` type
    (which differs from ``type`` only under ``FALLBACK_ENV``)."""

    type: str
    index: int | None = None
    requested: str = "cpu"

    @property
    def device(self) -> torch.device:
        """The ``torch.device`` every tensor of a step is made on."""
        return torch.device(self.type) if self.index is None else torch.device(self.type, self.index)

    @property
    def backend(self) -> str:
        """The process group's backend string: gloo alone on the CPU; on an accelerator,
        gloo for CPU tensors (host objects) beside the accelerator's own backend."""
        return "gloo" if self.type == "cpu" else f"cpu:gloo,{self.type}:{BACKENDS[self.type]}"

    def select(self) -> None:
        """Make ``index`` the current device of this process (collectives and the
        allocator use it); nothing to do on the CPU."""
        if self.type != "cpu":
            device_module(self.type).set_device(self.index)

    def peak_memory_bytes(self) -> int:
        """This rank's peak memory so far: the accelerator allocator's peak, or the
        process's peak resident set on the CPU (ru_maxrss, kB on Linux)."""
        if self.type == "cpu":
            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        return int(device_module(self.type).max_memory_allocated(self.index))


def device_module(device_type: str) -> ModuleType:
    """``torch.cuda``, or ``torch_npu.npu`` (importing torch_npu, which registers the npu
    device and hccl; only ever for a recipe that asks for npu)."""
    if device_type == "cuda":
        return torch.cuda
    if device_type == "npu":
        return importlib.import_module("torch_npu").npu
    raise ValueError(f"no device module for device type {device_type!r} (one of {', '.join(DEVICE_TYPES[1:])})")


def is_present(device_type: str) -> bool:
    """Whether this machine has a usable device of ``device_type`` (the CPU always)."""
    if device_type == "cpu":
        return True
    try:
        return bool(device_module(device_type).is_available())
    except ImportError:  # no torch_npu here
        return False


def resolve_run_device(device_type: str, *, where: str = "recipe") -> RunDevice:
    """The run device for a recipe's ``accelerator.device_type``: that device of
    LOCAL_RANK, or, where it is absent, a refusal naming the key and what was found (the
    CPU instead only when ``FALLBACK_ENV`` says ``cpu``)."""
    if device_type not in DEVICE_TYPES:
        raise DeviceUnavailableError(f"{where}: accelerator.device_type: expected one of {', '.join(DEVICE_TYPES)}, "
                                     f"got {device_type!r}")
    if is_present(device_type):
        index = None if device_type == "cpu" else int(os.environ.get("LOCAL_RANK", "0"))
        return RunDevice(device_type, index, device_type)
    if os.environ.get(FALLBACK_ENV) == "cpu":
        return RunDevice("cpu", None, device_type)
    raise DeviceUnavailableError(
        f"{where}: accelerator.device_type is {device_type!r}, but this machine has no usable {device_type} device "
        f"({_absence(device_type)}); fix: run on a machine with one, set accelerator.device_type: cpu, or set "
        f"{FALLBACK_ENV}=cpu to train on the CPU on purpose")


def _absence(device_type: str) -> str:
    """What was found instead, in words."""
    if device_type == "npu":
        try:
            importlib.import_module("torch_npu")
        except ImportError:
            return "torch_npu is not installed"
        return "torch_npu reports no NPU"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no GPU"
