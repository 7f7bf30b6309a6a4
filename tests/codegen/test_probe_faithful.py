"""The verify probe and the dataflow trace's copy have the model's modules, or refuse."""

from copy import deepcopy as copy_of

import pytest
import torch
from transformers import AutoModelForCausalLM

from hyper_parallel.codegen.check.probe import (
    ProbeError,
    cut_depth,
    faithful_probe_config,
    layer_kinds,
    shrink_widths,
)
from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.mesh import ParallelDims
from hyper_parallel.distributed.model_parts import decoder_layers
from hyper_parallel.planning.dataflow import analyze
from hyper_parallel.planning.plan_lint import PlanError, lint_config_divisibility
from hyper_parallel.planning.planner import ShardingPlanner
from hyper_parallel.planning.stand_ins import pattern
from hyper_parallel.testing.tiny_families import meta_model, tiny_config


def _probe(config, tp: int = 1):
    wide = shrink_widths(config, tp=tp, ep=1, seq_len=8, where="test")
    return faithful_probe_config(wide, remote=False, where="test")[0]


def test_widths_equal_to_hidden_follow_it_so_the_probe_has_no_extra_projection():
    # OPT builds project_in/project_out only when word_embed_proj_dim != hidden_size; a probe
    # shrinking hidden alone had them and the model did not (verify failed on a module the
    # model lacks).
    config = tiny_config("opt")
    assert config.word_embed_proj_dim == config.hidden_size
    probe = _probe(config, tp=2)
    assert probe.word_embed_proj_dim == probe.hidden_size != config.hidden_size
    model_names = {pattern(name) for name, _ in meta_model(config).named_modules()}
    assert {pattern(name) for name, _ in meta_model(probe).named_modules()} == model_names


def test_a_config_counting_sublayers_is_cut_by_whole_layers():
    # Longcat-Flash: num_hidden_layers counts two attention sublayers per decoder layer
    # (2 * num_layers); cut as if it counted layers, the probe had no layers at all, which
    # verified nothing (and was refused since). It is cut by whole layers now.
    config = tiny_config("longcat_flash")
    probe = _probe(config)
    layers = decoder_layers(meta_model(probe))[1]
    assert probe.num_hidden_layers == 2 * len(layers) and len(layers) >= 1
    assert {pattern(name) for name, _ in meta_model(probe).named_modules()} == {
        pattern(name) for name, _ in meta_model(config).named_modules()}


def test_another_count_of_the_layers_is_cut_with_the_depth():
    # xLSTM builds ``num_blocks`` blocks and keeps ``num_hidden_layers`` as a separate copy:
    # cutting only the latter left two blocks for one layer, and verify refused the family.
    config = tiny_config("xlstm")
    assert config.num_blocks == config.num_hidden_layers > 1
    probe = cut_depth(config, 1, "xlstm")
    assert probe.num_blocks == probe.num_hidden_layers == 1
    assert len(decoder_layers(meta_model(probe))[1]) == 1


def test_a_model_whose_layer_list_is_no_fraction_of_num_hidden_layers_is_refused():
    config = tiny_config("llama")
    model = meta_model(config)
    assert len(model.model.layers) == 2
    config.num_hidden_layers = 3
    with pytest.raises(ProbeError, match=r"num_hidden_layers=3, but the decoder layers do not number that or a whole "
                                         r"fraction of it \(model.layers holds 2\)"):
        layer_kinds(model, config)


def test_biogpt_tiny_config_has_no_dropout():
    config = tiny_config("biogpt")
    assert config.hidden_dropout_prob == config.attention_probs_dropout_prob == 0.0


def test_a_module_after_the_layers_on_the_split_stream_sums_its_gradient_over_cp():
    # OPT with word_embed_proj_dim != hidden_size: project_out reads the final norm's output,
    # which under cp is each rank's piece of the sequence: it needs an entry naming cp.
    config = copy_of(tiny_config("opt"))
    config.word_embed_proj_dim = 16  # unlike hidden_size in the model and in its probe
    torch.manual_seed(0)
    copy = AutoModelForCausalLM.from_config(_probe(config), attn_implementation="eager")
    flow = analyze(copy, torch.randint(0, 64, (1, 8)), tp=1)
    assert "model.decoder.project_out" in flow.after_layers
    assert "model.decoder.project_in" not in flow.after_layers  # before the layers: full sequence
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dims = ParallelDims(cp=2)
    result = ShardingPlanner(model, Layout(dims), dataflow=flow).plan()
    entry = result.modules["model.decoder.project_out"]
    assert type(entry.in_src[0]["cp"]).__name__ == "Shard"
    before = result.modules.get("model.decoder.project_in")  # full sequence: nothing split over cp
    assert before is None or not any("cp" in (named or {}) for named in (before.in_src or ()))


def test_the_probe_plan_drops_only_entries_of_layers_the_probe_cut_off():
    # Doge's decoder layers have parameters of their own, so each layer keeps an exact key
    # ("model.layers.1": a glob "model.layers.*" would also match the layers' submodules);
    # the probe, one layer deep, has no model.layers.1.
    from hyper_parallel.codegen.check.verify_worker import probe_plan

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_probe(tiny_config("doge")))
    assert len(model.model.layers) == 1
    plan = {"format": 2, "modules": {"model.layers.0": {"role": "replicate"}, "model.layers.1": {"role": "replicate"},
                                     "model.layers.*.mlp.up_proj": {"role": "colwise"}, "lm_head": {"role": "lm_head"},
                                     "model.layers.10x": {"role": "replicate"}}}
    kept = probe_plan(plan, model)
    assert sorted(kept["modules"]) == ["lm_head", "model.layers.*.mlp.up_proj", "model.layers.0", "model.layers.10x"]
    assert kept["format"] == 2 and len(plan["modules"]) == 5  # the bundle's plan is not changed


def _heads_by_layer(config) -> list[tuple[int, int, int]]:
    return [(layer.num_attention_heads, layer.num_key_value_heads, layer.head_dim) for layer in config.per_layer_config]


def test_a_per_layer_config_is_shrunk_layer_by_layer_and_cut_with_its_layers():
    # dots3's sliding layers have heads of their own (transformers' per_layer_config): the
    # model-wide value of such a key raises when read, each layer's heads shrink by the
    # model-wide rule from its own counts, and a cut below a layer drops that layer's values
    # (transformers refuses per-layer indices past the depth).
    config = tiny_config("dots3_note_text")
    assert config.is_heterogeneous and len(set(_heads_by_layer(config))) == 2
    wide = shrink_widths(config, tp=2, ep=1, seq_len=8, where="test")
    assert _heads_by_layer(wide) == [(2, 2, 8), (2, 2, 8), (2, 2, 16)], _heads_by_layer(config)
    assert not wide.allow_global_per_layer_attribute_access  # still read per layer, as the model does
    assert _heads_by_layer(cut_depth(wide, 2, "test")) == [(2, 2, 8), (2, 2, 8)]
    probe = _probe(config, tp=2)
    assert probe.num_hidden_layers == 3  # the sliding layer (own heads) is a kind of its own
    assert {pattern(name) for name, _ in meta_model(probe).named_modules()} == {
        pattern(name) for name, _ in meta_model(config).named_modules()}


def test_sizes_tp_splits_must_divide_in_every_layer_of_a_per_layer_config():
    config = tiny_config("dots3_note_text")  # 4 heads, the sliding layer 2
    lint_config_divisibility(config, ParallelDims(tp=2))
    with pytest.raises(PlanError, match=r"tp_size=4 does not divide config num_attention_heads=2"):
        lint_config_divisibility(config, ParallelDims(tp=4))


def test_a_layer_setting_only_its_kv_heads_keeps_a_valid_head_ratio_and_no_dropout():
    # A layer overriding num_key_value_heads alone: its query heads must shrink from its own
    # counts too (the model-wide shrink gave 2 query heads against its 3 kv heads), and its
    # own dropout is zeroed like the model's (verify runs in training mode).
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=96, num_attention_heads=12, num_key_value_heads=12, head_dim=8,
                         num_hidden_layers=3, intermediate_size=64, vocab_size=128,
                         per_layer_config={2: {"num_key_value_heads": 3, "attention_dropout": 0.2}})
    wide = shrink_widths(config, tp=1, ep=1, seq_len=8, where="test")
    assert [(layer.num_attention_heads, layer.num_key_value_heads, layer.attention_dropout)
            for layer in wide.per_layer_config] == [(2, 2, 0.0), (2, 2, 0.0), (12, 3, 0.0)]


@pytest.mark.parametrize("family", ["falcon_h1", "bamba", "mamba", "bailing_hybrid"])
def test_the_probe_of_a_hybrid_or_state_space_family_runs(family):
    """What verify's one-process reference runs: a probe whose per-layer lists were cut
    with the depth but whose pairs were not (falcon_h1's mlp_multipliers and
    time_step_limit at depth 2), a state-space model without attention heads (its widths
    kept), and group-limited routing with enough experts for its top-k (bailing_hybrid)."""
    config = tiny_config(family)
    probe = _probe(config, tp=2)
    for key in ("mlp_multipliers", "time_step_limit"):
        if hasattr(config, key):
            assert list(getattr(probe, key)) == list(getattr(config, key))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(probe)
    tokens = torch.randint(0, probe.vocab_size, (1, 8))
    assert torch.isfinite(model(input_ids=tokens, labels=tokens).loss)


def test_a_model_that_does_not_build_at_the_shortest_depth_gets_a_deeper_probe():
    """Zamba ties its shared transformer across hybrid layers: cut to the first hybrid
    layer it does not build; the probe takes the next depth that does."""
    config = tiny_config("zamba")
    wide = shrink_widths(config, tp=2, ep=1, seq_len=8, where="test")
    probe, depth, kinds = faithful_probe_config(wide, remote=False, where="test")
    with pytest.raises(Exception, match="tie_weights_keys"):
        AutoModelForCausalLM.from_config(cut_depth(wide, 3, "test"))
    assert 3 < depth <= len(kinds) and probe.num_hidden_layers == depth
    assert AutoModelForCausalLM.from_config(probe) is not None
