"""Planning one decoder layer per kind (``planning/layer_kinds.py``) plans exactly as
planning every layer, and plans no more layers than there are kinds, however deep the
model: dense and MoE layers mixed (Qwen3-MoE's ``mlp_only_layers`` and
``decoder_sparse_step``), and a hybrid of Mamba and attention layers (Jamba).
The weight map derived on one layer per kind is the one derived on every layer."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from hyper_parallel.codegen.check.probe import faithful_probe_config
from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.mesh import ParallelDims
from hyper_parallel.distributed.model_parts import decoder_layers
from hyper_parallel.distributed.weight_map import weight_map_text
from hyper_parallel.planning import weight_map_by_kind
from hyper_parallel.planning.dataflow import analyze
from hyper_parallel.planning.layer_kinds import planning_kinds
from hyper_parallel.planning.local_widths_dry_run import local_widths_dry_run
from hyper_parallel.planning.module_roles import ModuleRoles
from hyper_parallel.planning.planner import ShardingPlanner
from hyper_parallel.testing.tiny_families import construct_config

LAYOUTS = {"tp2": Layout(ParallelDims(tp=2)),
           "tp2_sp_lp": Layout(ParallelDims(tp=2), sequence_parallel=True, loss_parallel=True),
           "cp2": Layout(ParallelDims(cp=2))}


def _dense_and_moe(layers: int) -> Qwen3MoeConfig:
    """MoE on every second layer, except layer 5 (``mlp_only_layers``): dense and MoE
    layers, each kind recurring past the traced prefix."""
    return Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[0, 5])


def _mamba_and_attention(layers: int):
    """Jamba: Mamba layers with an attention layer every fourth, MoE MLPs every second."""
    return construct_config("jamba", {"num_hidden_layers": layers, "attn_layer_period": 4, "attn_layer_offset": 1,
                                      "expert_layer_period": 2, "expert_layer_offset": 1})


def _model_and_flow(config, layout: Layout):
    """The meta model of ``config`` and the dataflow of its tiny prefix holding every layer
    kind, as derive traces it (``trace_dataflow``)."""
    config._attn_implementation = "eager"
    split = "cp" if layout.cp > 1 else "sp" if layout.sequence_parallel else None
    tiny, _, _ = faithful_probe_config(config, remote=False, where="test", min_depth=2 if split else 1)
    torch.manual_seed(0)
    small = AutoModelForCausalLM.from_config(tiny, attn_implementation="eager", dtype=torch.float32)
    ids = torch.randint(0, tiny.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    flow = analyze(small, ids, tp=layout.tp, dry_run=local_widths_dry_run(small, ids, layout.tp),
                   sequence_split=split)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model, flow


def _layers_classified(monkeypatch, model) -> set[int]:
    """Record the decoder layers whose modules the role rules classify from now on."""
    layers_fqn = decoder_layers(model)[0]
    seen: set[int] = set()
    classify = ModuleRoles.role

    def recording(self, fqn, module):
        if fqn.startswith(layers_fqn + "."):
            seen.add(int(fqn[len(layers_fqn) + 1:].split(".")[0]))
        return classify(self, fqn, module)

    monkeypatch.setattr(ModuleRoles, "role", recording)
    return seen


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("make_config", [_dense_and_moe, _mamba_and_attention])
def test_one_layer_per_kind_plans_as_every_layer(make_config, layout, monkeypatch):
    model, flow = _model_and_flow(make_config(12), LAYOUTS[layout])
    kinds = planning_kinds(model, traced=flow.classes)
    every = ShardingPlanner(model, LAYOUTS[layout], dataflow=flow).plan_every_layer()
    classified = _layers_classified(monkeypatch, model)
    by_kind = ShardingPlanner(model, LAYOUTS[layout], dataflow=flow).plan()
    assert classified == set(kinds.representatives) and len(kinds.representatives) < 12
    assert list(by_kind.modules) == list(every.modules)  # the generated file's order
    assert by_kind.modules == every.modules
    assert by_kind.roles == every.roles
    assert (by_kind.notes, by_kind.applied_axes, by_kind.recorded_axes) == (
        every.notes, every.applied_axes, every.recorded_axes)


def test_the_layers_planned_in_full_are_one_per_kind_at_any_depth(monkeypatch):
    """Layer 0 (the sequence split enters there) and layer 1 (traced: its facts are its own)
    alone, then one dense and one MoE layer for all the others, at 12 layers as at 24."""
    for layers in (12, 24):
        model, flow = _model_and_flow(_dense_and_moe(layers), LAYOUTS["tp2_sp_lp"])
        classified = _layers_classified(monkeypatch, model)
        ShardingPlanner(model, LAYOUTS["tp2_sp_lp"], dataflow=flow).plan()
        assert planning_kinds(model, traced=flow.classes).representatives == (0, 1, 2, 3)
        assert classified == {0, 1, 2, 3}, layers


def test_the_weight_map_of_one_layer_per_kind_is_every_layers(monkeypatch):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_dense_and_moe(12))
    derived_on: list[int] = []
    derive = weight_map_by_kind.derive_weight_map

    def recording(view, *args, **kwargs):
        derived_on.append(len(decoder_layers(view)[1]))
        return derive(view, *args, **kwargs)

    monkeypatch.setattr(weight_map_by_kind, "derive_weight_map", recording)
    by_kind = weight_map_by_kind.weight_map_by_kind(model)
    assert json.dumps(by_kind) == json.dumps(weight_map_text(model))
    assert derived_on == [3]  # the first layer, then one dense and one MoE layer
