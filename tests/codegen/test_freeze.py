"""Freezing compresses layer-indexed entries only where the pattern means the same modules."""

import pytest

from hyper_parallel.codegen.plan.freeze import FreezeError, freeze_plan

NAMES = ["", "model", "model.layers", "model.layers.0", "model.layers.0.attn", "model.layers.0.mlp",
         "model.layers.1", "model.layers.1.attn", "model.layers.1.mlp", "model.layers.2", "model.layers.2.attn",
         "model.layers.2.mlp"]


def _entry(role: str, placement: str = "shard(0)") -> dict:
    return {"role": role, "state_shardings": {"weight": {"tp": placement}}, "in_src": None, "in_dst": None,
            "out_src": None, "out_dst": None, "local_map": False}


def _plan(modules: dict) -> dict:
    return {"format": 2, "layout": {"dp": 1, "cp": 1, "tp": 2, "ep": 1, "pp": 1, "sequence_parallel": False, "loss_parallel": False}, "applied_axes": ["tp"], "recorded_axes": {},
            "modules": modules}


def test_equal_entries_on_every_layer_become_one_pattern():
    frozen = freeze_plan(_plan({f"model.layers.{i}.attn": _entry("colwise") for i in range(3)}), NAMES)
    assert list(frozen["modules"]) == ["model.layers.*.attn"]


def test_an_entry_on_one_layer_keeps_its_exact_name():
    # "model.layers.*" would match every module below model.layers, not just layer 0
    modules = {"model.layers.0": _entry("sequence_split"), **{f"model.layers.{i}.attn": _entry("colwise")
                                                              for i in range(3)}}
    frozen = freeze_plan(_plan(modules), NAMES)
    assert list(frozen["modules"]) == ["model.layers.0", "model.layers.*.attn"]


def test_entries_that_differ_between_layers_stay_exact():
    modules = {f"model.layers.{i}.mlp": _entry("colwise", "shard(0)" if i else "shard(1)") for i in range(3)}
    frozen = freeze_plan(_plan(modules), NAMES)
    assert list(frozen["modules"]) == ["model.layers.0.mlp", "model.layers.1.mlp", "model.layers.2.mlp"]


def test_a_subset_of_layers_is_not_compressed():
    modules = {f"model.layers.{i}.mlp": _entry("colwise") for i in (1, 2)}
    assert list(freeze_plan(_plan(modules), NAMES)["modules"]) == ["model.layers.1.mlp", "model.layers.2.mlp"]


def test_bad_placement_names_the_module():
    with pytest.raises(FreezeError, match=r"model\.layers\.0\.attn.*halfshard"):
        freeze_plan(_plan({"model.layers.0.attn": _entry("colwise", "halfshard")}), NAMES)


def test_children_of_a_sequential_are_compressed_by_layer_only():
    # CTRL's MLP is an nn.Sequential: ffn.0 (colwise) and ffn.2 (rowwise) differ, so every
    # index as * cannot hold both; the layer index alone can, and a probe with fewer layers
    # (verify's) still finds its entries.
    names = ["", "h"] + [f"h.{i}{part}" for i in range(2) for part in ("", ".ffn", ".ffn.0", ".ffn.1", ".ffn.2")]
    modules = {f"h.{i}.ffn.0": _entry("colwise") for i in range(2)}
    modules.update({f"h.{i}.ffn.2": _entry("rowwise", "shard(1)") for i in range(2)})
    frozen = freeze_plan(_plan(modules), names)
    assert sorted(frozen["modules"]) == ["h.*.ffn.0", "h.*.ffn.2"]


QKV_NAMES = ["", "model", "model.layers"] + [f"model.layers.{i}.attn.{p}_proj" for i in range(2) for p in "qkvo"]


def test_equal_entries_one_letter_apart_share_one_class_key():
    modules = {f"model.layers.{i}.attn.{p}_proj": _entry("rowwise" if p == "o" else "colwise", "shard(0)")
               for i in range(2) for p in "qkvo"}
    frozen = freeze_plan(_plan(modules), QKV_NAMES)
    assert list(frozen["modules"]) == ["model.layers.*.attn.[qkv]_proj", "model.layers.*.attn.o_proj"]


def test_a_class_key_only_merges_equal_entries_and_never_digits():
    modules = {f"model.layers.{i}.attn.{p}_proj": _entry("colwise", "shard(1)" if p == "v" else "shard(0)")
               for i in range(2) for p in "qkv"}
    frozen = freeze_plan(_plan(modules), QKV_NAMES)
    assert list(frozen["modules"]) == ["model.layers.*.attn.[qk]_proj", "model.layers.*.attn.v_proj"]
    layers = {f"model.layers.{i}.mlp": _entry("colwise", "shard(0)" if i else "shard(1)") for i in range(3)}
    assert "[" not in "".join(freeze_plan(_plan(layers), NAMES)["modules"])  # layers.[12] would read as twelve
