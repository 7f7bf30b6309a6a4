"""The run device and the one door to Ascend (issue 52, items 2 and 9): ``platform/device.py``
against a stand-in ``torch_npu`` that records what it is asked, and a recipe whose device
this machine lacks refused at the trainer's start in one line (exit 2)."""

import subprocess
import sys
import types

import pytest
import yaml

from hyper_parallel.platform import device as run_device
from hyper_parallel.platform.device import FALLBACK_ENV, DeviceUnavailableError, RunDevice, resolve_run_device
from tests.project_fixtures import REPO, TINY_RECIPE


class StandInNpu:
    """``torch_npu.npu`` as the door uses it: the calls it receives, in order."""

    def __init__(self, available: bool = True):
        self.available, self.calls = available, []

    def is_available(self):
        self.calls.append(("is_available",))
        return self.available

    def set_device(self, index):
        self.calls.append(("set_device", index))

    def max_memory_allocated(self, index=None):
        self.calls.append(("max_memory_allocated", index))
        return 7 * 2**20


@pytest.fixture
def npu(monkeypatch):
    stand_in = StandInNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu=stand_in))
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv(FALLBACK_ENV, raising=False)
    return stand_in


def test_an_npu_run_goes_through_torch_npu_alone(npu):
    run = resolve_run_device("npu", where="r.yaml")
    assert (run.type, run.index, run.requested) == ("npu", 3, "npu")
    assert run.backend == "cpu:gloo,npu:hccl"  # host objects on gloo beside hccl
    run.select()
    assert run.peak_memory_bytes() == 7 * 2**20
    assert npu.calls == [("is_available",), ("set_device", 3), ("max_memory_allocated", 3)]


def test_an_absent_npu_is_refused_naming_the_key_and_what_was_found(npu, monkeypatch):
    npu.available = False
    with pytest.raises(DeviceUnavailableError, match=r"r\.yaml: accelerator\.device_type is 'npu', but this machine "
                                                     r"has no usable npu device \(torch_npu reports no NPU\)"):
        resolve_run_device("npu", where="r.yaml")
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # not installed: the import fails
    with pytest.raises(DeviceUnavailableError, match=r"torch_npu is not installed.*" + FALLBACK_ENV):
        resolve_run_device("npu", where="r.yaml")


def test_the_cpu_fallback_is_asked_for_by_name(npu, monkeypatch):
    npu.available = False
    monkeypatch.setenv(FALLBACK_ENV, "cpu")
    run = resolve_run_device("npu")
    assert run == RunDevice("cpu", None, "npu") and run.backend == "gloo" and str(run.device) == "cpu"
    assert run.peak_memory_bytes() > 0  # the process's resident peak
    assert ("set_device", 3) not in npu.calls


def test_the_cpu_is_always_present_and_cuda_is_judged_by_torch(monkeypatch):
    monkeypatch.delenv(FALLBACK_ENV, raising=False)
    assert resolve_run_device("cpu") == RunDevice("cpu", None, "cpu")
    monkeypatch.setattr(run_device.torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailableError, match="accelerator.device_type is 'cuda'"):
        resolve_run_device("cuda", where="r.yaml")
    with pytest.raises(DeviceUnavailableError, match="expected one of cpu, cuda, npu, got 'tpu'"):
        resolve_run_device("tpu", where="r.yaml")


@pytest.mark.skipif(run_device.is_present("cuda"), reason="this machine has a GPU: a cuda recipe is not refused here")
def test_a_cuda_recipe_on_a_machine_without_a_gpu_is_refused_in_one_line(tmp_path):
    recipe = yaml.safe_load((REPO / TINY_RECIPE).read_text())
    recipe["accelerator"]["device_type"] = "cuda"
    recipe["model"]["pretrained_model_name_or_path"] = str(REPO / "recipes/tiny_cpu" /
                                                           recipe["model"]["pretrained_model_name_or_path"])
    path = tmp_path / "cuda.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    env = {key: value for key, value in __import__("os").environ.items() if key != FALLBACK_ENV}
    proc = subprocess.run([sys.executable, "-m", "hyper_parallel.trainer", "--config", str(path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "accelerator.device_type is 'cuda'" in lines[0] and str(path) in lines[0], lines
