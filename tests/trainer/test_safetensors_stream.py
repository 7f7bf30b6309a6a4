"""The streamed safetensors writer: what safetensors' own loader reads back, tensor for tensor."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hyper_parallel.trainer.safetensors_stream import StreamedSafetensors


def test_streamed_file_loads_with_safetensors(tmp_path):
    tensors = {"a.weight": torch.randn(3, 5), "b": torch.randn(2, 3, 4).to(torch.bfloat16),
               "scalar": torch.tensor(3.0), "empty": torch.zeros(0, 4), "mask": torch.tensor([True, False]),
               "transposed": torch.randn(4, 6).t(), "ids": torch.arange(7)}
    file = StreamedSafetensors(tmp_path / "m.safetensors", {"format": "pt"})
    for name, tensor in tensors.items():
        file.add(name, tensor)
    assert file.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert file.close() == tmp_path / "m.safetensors"
    loaded = load_file(str(tmp_path / "m.safetensors"))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]  # no spill or partial file left


def test_a_name_twice_or_an_unstorable_dtype_is_refused(tmp_path):
    file = StreamedSafetensors(tmp_path / "m.safetensors", {})
    file.add("x", torch.ones(2))
    with pytest.raises(ValueError, match="tensor x added twice"):
        file.add("x", torch.ones(2))
    with pytest.raises(ValueError, match="dtype torch.complex64"):
        file.add("c", torch.ones(2, dtype=torch.complex64))
