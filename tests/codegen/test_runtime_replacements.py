"""runtime.hyper_apply_replacements: matching, exactly-once, and its errors."""

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeModel

from hyper_parallel.runtime import REPLACED_RECORD, ReplacementError, hyper_apply_replacements
from hyper_parallel.models.qwen3_moe.adapter.replacements import Qwen3MoeFusedAttention

TINY_CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipes/tiny_cpu/models/tiny-qwen3-moe"
ATTENTION_TYPE = "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention"
FUSED_ATTENTION = "hyper_parallel.models.qwen3_moe.adapter.replacements.replace_qwen3_moe_flash_attention"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 2)


class Wrapped(nn.Module):
    """Wraps a module, keeping its weights (the shape a real replacement has)."""

    def __init__(self, inner: nn.Module, scale: float = 1.0) -> None:
        super().__init__()
        self.inner = inner
        self.scale = scale

    def forward(self, x):
        return self.inner(x) * self.scale


made: list[nn.Module] = []


def wrap(module: nn.Module, **kwargs) -> nn.Module:
    made.append(module)
    return Wrapped(module, **kwargs)


def not_a_module(module: nn.Module) -> str:
    return "oops"


WRAP = f"{__name__}.wrap"


def tiny_config():
    config = AutoConfig.from_pretrained(TINY_CONFIG_DIR)
    config._attn_implementation = "eager"
    return config


def test_glob_replaces_every_match_with_static_kwargs_and_records_it():
    made.clear()
    toy = Toy()
    old = [toy.layers[0].attn, toy.layers[1].attn]
    count = hyper_apply_replacements(toy, [{"match": "layers.*.attn", "module_type": "torch.nn.Linear",
                                            "target": WRAP, "kwargs": {"scale": 2.0}}])
    assert count == 2 and made == old
    assert all(isinstance(b.attn, Wrapped) and b.attn.scale == 2.0 for b in toy.layers)
    assert toy.layers[0].attn.inner is old[0]  # the weights travel with the module
    assert getattr(toy, REPLACED_RECORD) == {"layers.0.attn": WRAP, "layers.1.attn": WRAP}


def test_a_second_call_replaces_nothing():
    made.clear()
    toy = Toy()
    replacements = [{"match": "*.attn", "target": WRAP}]
    assert hyper_apply_replacements(toy, replacements) == 2
    assert hyper_apply_replacements(toy, replacements) == 0
    assert len(made) == 2 and isinstance(toy.layers[0].attn.inner, nn.Linear)


def test_entries_apply_in_order_and_see_each_others_results():
    toy = Toy()
    hyper_apply_replacements(toy, [{"match": "layers.0.attn", "target": WRAP},
                                   {"match": "layers.0.attn.inner", "target": WRAP, "kwargs": {"scale": 3.0}}])
    assert isinstance(toy.layers[0].attn.inner, Wrapped) and toy.layers[0].attn.inner.scale == 3.0


def test_target_that_does_not_import_names_target_and_recipe_key():
    missing = "hyper_parallel.models.no_such_module.make"
    with pytest.raises(ReplacementError, match=r"plan_overrides\[3\]\.replace_module\._target_: cannot import "
                                               r"replacement target 'hyper_parallel\.models\.no_such_module\.make'"):
        hyper_apply_replacements(Toy(), [{"match": "*.attn", "target": missing,
                                          "origin": "plan_overrides[3].replace_module._target_"}])
    with pytest.raises(ReplacementError, match=r"plan_overrides entry with match '\*\.attn'.*_target_: "
                                               r"cannot import replacement target .*no_such_factory"):
        hyper_apply_replacements(Toy(), [{"match": "*.attn", "target": f"{__name__}.no_such_factory"}])


def test_match_that_hits_nothing_is_an_error():
    with pytest.raises(ReplacementError, match=r"match 'layers\.\*\.self_attn' hits no module of Toy.*"
                                               r"layers, layers\.0, layers\.0\.attn"):
        hyper_apply_replacements(Toy(), [{"match": "layers.*.self_attn", "target": WRAP}])


def test_wrong_module_type_names_fqn_expected_and_actual():
    with pytest.raises(ReplacementError, match=r"module layers\.0\.mlp is torch\.nn\.modules\.container\."
                                               r"Sequential, expected torch\.nn\.Linear \(match '\*\.mlp'\)"):
        hyper_apply_replacements(Toy(), [{"match": "*.mlp", "module_type": "torch.nn.Linear", "target": WRAP}])


def test_exact_type_rejects_subclasses():
    class MyLinear(nn.Linear):
        pass

    toy = Toy()
    toy.head = MyLinear(4, 2)
    assert hyper_apply_replacements(toy, [{"match": "head", "module_type": "torch.nn.Linear", "target": WRAP}]) == 1
    toy.head = MyLinear(4, 2)
    with pytest.raises(ReplacementError, match=r"expected exactly torch\.nn\.Linear"):
        hyper_apply_replacements(toy, [{"match": "head", "module_type": "torch.nn.Linear", "exact_type": True,
                                        "target": WRAP}])


def test_factory_must_return_a_module():
    with pytest.raises(ReplacementError, match=r"not_a_module returned str for head, expected an nn\.Module"):
        hyper_apply_replacements(Toy(), [{"match": "head", "target": f"{__name__}.not_a_module"}])


def test_hf_model_fqns_are_the_planners_and_replacement_is_idempotent():
    config = tiny_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    replacements = [{"match": "model.layers.1.self_attn", "module_type": ATTENTION_TYPE, "target": FUSED_ATTENTION}]
    assert hyper_apply_replacements(model, replacements) == 1
    assert isinstance(model.model.layers[1].self_attn, Qwen3MoeFusedAttention)
    assert not isinstance(model.model.layers[0].self_attn, Qwen3MoeFusedAttention)
    assert hyper_apply_replacements(model, replacements) == 0


def test_base_model_matches_under_its_prefix_and_defers_outside_patterns():
    config = tiny_config()
    with torch.device("meta"):
        base = Qwen3MoeModel(config)
    # Exact FQN as the planner spells it on the causal-LM model, and the bare form.
    assert hyper_apply_replacements(base, [{"match": "model.layers.0.self_attn", "target": FUSED_ATTENTION}]) == 1
    assert hyper_apply_replacements(base, [{"match": "layers.1.self_attn", "target": FUSED_ATTENTION}]) == 1
    # lm_head lives in the head model: the head's own call checks it, not the base model's.
    assert hyper_apply_replacements(base, [{"match": "lm_head", "target": FUSED_ATTENTION}]) == 0
    with pytest.raises(ReplacementError, match=r"match 'model\.layers\.\*\.nothing' hits no module of Qwen3MoeModel"):
        hyper_apply_replacements(base, [{"match": "model.layers.*.nothing", "target": FUSED_ATTENTION}])
