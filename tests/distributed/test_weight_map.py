"""The static weight mapping (``distributed/weight_map.py``): derived with transformers'
own conversion machinery on a meta model, recorded one line per name pattern, and read
back by the sharded loader.

- Qwen3-MoE: the per-expert checkpoint (``mlp.experts.E.gate_proj/up_proj/down_proj``,
  what ``save_pretrained`` writes) stacked into ``gate_up_proj`` / ``down_proj``, each
  expert's gate and up feeding their halves;
- a dense family (Llama): every tensor under its own name;
- a replacement that restacks and renames (``gate_up_proj`` → ``w1`` / ``w3``, declared
  as transformers ``WeightConverter`` / ``WeightRenaming`` on the replacement class).
"""

import pytest
import torch
import transformers
from torch import nn
from transformers.core_model_loading import Chunk, WeightConverter, WeightRenaming

from hyper_parallel.distributed.checkpoint_names import model_tensor_names
from hyper_parallel.distributed.sharded_load import load_sharded_safetensors
from hyper_parallel.distributed.weight_map import (
    RecordedMap,
    Rule,
    WeightMapError,
    parse_rule,
    weight_map_text,
)
from tests.project_fixtures import REPO

CONFIG_DIR = REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"
EXPERTS, MOE_I = 4, 32  # the tiny Qwen3-MoE's experts and moe_intermediate_size


def _qwen3_moe(device="meta", **overrides):
    config = transformers.AutoConfig.from_pretrained(CONFIG_DIR, **overrides)
    torch.manual_seed(11)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def test_qwen3_moe_per_expert_checkpoint_maps_onto_stacked_gate_up_proj():
    recorded = weight_map_text(_qwen3_moe())

    experts = "model.layers.*.mlp.experts"
    assert recorded[f"{experts}.*.gate_proj.weight"] == f"{experts}.gate_up_proj[*, 0:{MOE_I}]"
    assert recorded[f"{experts}.*.up_proj.weight"] == f"{experts}.gate_up_proj[*, {MOE_I}:{2 * MOE_I}]"
    assert recorded[f"{experts}.*.down_proj.weight"] == f"{experts}.down_proj[*]"
    assert recorded["model.layers.*.self_attn.q_proj.weight"] == "model.layers.*.self_attn.q_proj.weight"
    assert len(recorded) == 15  # one line per pattern, not per layer or expert
    # expanded for one key: expert 3 of layer 1, the up half
    assert RecordedMap.of(recorded).rules_for("model.layers.1.mlp.experts.3.up_proj.weight") == [
        Rule("model.layers.1.mlp.experts.gate_up_proj", (3, (MOE_I, 2 * MOE_I)))]
    assert weight_map_text(_qwen3_moe()) == recorded  # deterministic


def test_a_dense_family_maps_every_tensor_to_its_own_name():
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      tie_word_embeddings=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    recorded = weight_map_text(model)

    assert all(key == value for key, value in recorded.items()), recorded
    assert "model.layers.*.mlp.gate_proj.weight" in recorded
    assert "lm_head.weight" not in recorded  # tied: save_pretrained stores the embedding once



def test_keys_with_a_number_and_a_name_at_one_place_are_ordered():
    """Laguna's checkpoint holds ``mlp.experts.0...`` beside ``mlp.experts.<name>`` tensors:
    ordering its keys compared an int with a str and derive crashed at every layout."""
    from hyper_parallel.testing.tiny_families import tiny_config

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_config("laguna"))
    recorded = weight_map_text(model)
    assert recorded and weight_map_text(model) == recorded

# --- a replacement that restacks and renames -----------------------------------------------------


class SplitExperts(nn.Module):
    """Qwen3-MoE's packed experts with gate and up as separate stacks (``w1``, ``w3``) and
    ``down_proj`` as ``w2`` (torchtitan's names); it says so in transformers' terms."""

    checkpoint_conversion = [
        WeightConverter("gate_up_proj", ["w1", "w3"], operations=[Chunk(dim=1)]),
        WeightRenaming("down_proj", "w2"),
    ]

    def __init__(self, original: nn.Module):
        super().__init__()
        gate_up, down = original.gate_up_proj, original.down_proj
        gate, up = gate_up.detach().chunk(2, dim=1)
        self.w1, self.w3 = nn.Parameter(gate.clone()), nn.Parameter(up.clone())
        self.w2 = nn.Parameter(down.detach().clone())


def _split_experts(model: nn.Module) -> nn.Module:
    """Every layer's experts replaced by :class:`SplitExperts` (as ``replace_module`` does)."""
    for layer in model.model.layers:
        layer.mlp.experts = SplitExperts(layer.mlp.experts)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_a_replacement_rename_is_composed_with_transformers_conversion(tied):
    hf_model = _qwen3_moe(tie_word_embeddings=tied)
    before = model_tensor_names(hf_model)
    recorded = weight_map_text(_split_experts(_qwen3_moe(tie_word_embeddings=tied)), hf_model=hf_model,
                               names_before_replacement=before)

    experts = "model.layers.*.mlp.experts"
    assert recorded[f"{experts}.*.gate_proj.weight"] == f"{experts}.w1[*]"
    assert recorded[f"{experts}.*.up_proj.weight"] == f"{experts}.w3[*]"
    assert recorded[f"{experts}.*.down_proj.weight"] == f"{experts}.w2[*]"
    assert ("lm_head.weight" in recorded) is not tied  # a tied lm_head is the embedding, stored once


def test_the_loader_fills_a_renamed_replacement_from_the_recorded_map(tmp_path):
    source = _qwen3_moe("cpu")
    source.save_pretrained(tmp_path)  # per-expert tensors on disk
    hf_meta = _qwen3_moe()
    model = _split_experts(_qwen3_moe("cpu"))
    recorded = weight_map_text(_split_experts(_qwen3_moe()), hf_model=hf_meta,
                               names_before_replacement=model_tensor_names(hf_meta))
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()

    report = load_sharded_safetensors(model, tmp_path, weight_map=recorded)

    assert report.missing == [] and report.notes == []
    for layer, original in zip(model.model.layers, source.model.layers):
        gate, up = original.mlp.experts.gate_up_proj.chunk(2, dim=1)
        assert torch.equal(layer.mlp.experts.w1, gate) and torch.equal(layer.mlp.experts.w3, up)
        assert torch.equal(layer.mlp.experts.w2, original.mlp.experts.down_proj)
    assert torch.equal(model.model.embed_tokens.weight, source.model.embed_tokens.weight)


def test_a_replacement_that_renames_without_declaring_it_is_refused():
    class Undeclared(SplitExperts):
        checkpoint_conversion = None

    hf_model = _qwen3_moe()
    model = _qwen3_moe()
    model.model.layers[0].mlp.experts = Undeclared(model.model.layers[0].mlp.experts)
    with pytest.raises(WeightMapError, match="declares checkpoint_conversion"):
        weight_map_text(model, hf_model=hf_model, names_before_replacement=model_tensor_names(hf_model))


@pytest.mark.parametrize("text", [
    "a.b.w", "a.b.w[3, 0:32]", "a.w[:, 4:8] = [0:4]", "a.w = [:].permute(1, 0)", "a.q.weight = transformers(Interleave)"])
def test_rules_read_back_as_written(text):
    assert parse_rule(text).text() == text
