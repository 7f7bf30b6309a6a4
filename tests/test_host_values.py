"""The one door for values a step reads back to the host (platform/host_values.py): real
tensors read as before; fake tensors (dry-run --fake-tensors) take their stand-ins."""

import math

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hyper_parallel.platform.host_values import counts_to_host, outside_fake_tensors, to_host_float, to_host_list


def test_real_tensors_read_their_values():
    assert counts_to_host(torch.tensor([3, 0, 5]), total=8) == [3, 0, 5]
    assert to_host_float(torch.tensor(2.5)) == 2.5
    assert to_host_list(torch.tensor([7, 9]), stand_in=[0, 0]) == [7, 9]


def test_fake_tensors_take_an_even_spread_nan_and_the_stand_in():
    with FakeTensorMode():
        counts = torch.zeros(4, dtype=torch.long)
        assert counts_to_host(counts, total=10) == [3, 3, 2, 2]  # sums to the total, as routing does
        assert counts_to_host(torch.zeros(3, dtype=torch.long), total=0) == [0, 0, 0]
        assert math.isnan(to_host_float(torch.ones(())))
        assert to_host_list(torch.zeros(2), stand_in=[1, 2]) == [1, 2]


def test_host_bookkeeping_stays_real_under_a_fake_mode():
    with FakeTensorMode():
        with outside_fake_tensors():
            ranks = torch.arange(4).reshape(2, 2)
        assert ranks.tolist() == [[0, 1], [2, 3]]
