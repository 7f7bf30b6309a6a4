import dataclasses

import pytest
import torch
from torch import nn

from hyper_parallel.models.common import Embedding, Linear, kaiming_uniform_, zeros_
from hyper_parallel.protocols import Function


def test_linear_matches_torch_linear_with_same_seed(dtype):
    torch.manual_seed(0)
    ref = nn.Linear(64, 32).to(dtype)
    torch.manual_seed(0)
    new = Linear.Config(in_features=64, out_features=32).build().to(dtype)
    assert isinstance(new, Linear) and isinstance(new, nn.Linear)
    assert torch.equal(new.weight, ref.weight) and torch.equal(new.bias, ref.bias)
    x = torch.randn(2, 8, 64, dtype=dtype)
    assert torch.equal(new(x), ref(x))


def test_linear_init_states_reproduces_kaiming_weight_and_zero_bias():
    torch.manual_seed(3)
    ref = nn.Linear(16, 8)
    new = Linear.Config(in_features=16, out_features=8).build()
    torch.manual_seed(3)
    new.init_states()
    assert torch.equal(new.weight, ref.weight)  # nn.Linear draws its weight first
    assert torch.equal(new.bias, torch.zeros(8))


def test_linear_param_init_is_configurable_and_serializable():
    cfg = Linear.Config(in_features=4, out_features=3, bias=False,
                        _param_init=Function.Config(fn=zeros_))
    layer = cfg.build()
    layer.init_states()
    assert layer.bias is None and torch.equal(layer.weight, torch.zeros(3, 4))
    data = cfg.to_dict()
    assert data["_param_init"]["fn"] == "hyper_parallel.models.common.param_init:zeros_"
    assert Linear.Config.from_dict(data) == cfg


def test_embedding_matches_torch_embedding_with_same_seed(dtype):
    torch.manual_seed(0)
    ref = nn.Embedding(256, 64, padding_idx=3).to(dtype)
    torch.manual_seed(0)
    new = Embedding.Config(num_embeddings=256, embedding_dim=64, padding_idx=3).build().to(dtype)
    ids = torch.randint(0, 256, (2, 8))
    assert torch.equal(new(ids), ref(ids))
    torch.manual_seed(5)
    new.init_states()
    torch.manual_seed(5)
    assert torch.equal(new.weight, nn.Embedding(256, 64, padding_idx=3).weight.to(dtype))


def test_config_is_keyword_only_and_slotted():
    with pytest.raises(TypeError):
        Linear.Config(4, 3)
    cfg = Linear.Config(in_features=4, out_features=3)
    with pytest.raises(AttributeError):
        cfg.out_feature = 5  # a typo must not pass silently
    assert "__slots__" in vars(Linear.Config)
    assert [f.name for f in dataclasses.fields(cfg)][:2] == ["sharding_config", "_param_init"]


def test_function_config_refuses_unimportable_callables():
    with pytest.raises(ValueError, match="module-level"):
        Function.Config(fn=lambda t: t)
    init = Function.Config(fn=kaiming_uniform_, kwargs={"a": 1.0})
    assert Function.Config.from_dict(init.to_dict()) == init
