"""Checkpoints in a family's on-disk layout load through transformers' own conversion
mapping, each rank still reading only its slices (``checkpoint_names``, ``sharded_load``).

The Mixtral checkpoints here are written by ``save_pretrained``, so they hold the names
transformers really writes: ``block_sparse_moe.experts.E.w1/w2/w3.weight`` per expert and
``block_sparse_moe.gate.weight``, which ``from_pretrained`` turns into
``mlp.experts.gate_up_proj`` / ``down_proj`` and ``mlp.gate.weight``.
"""

import dataclasses
import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.core_model_loading import Interleave, Split, WeightConverter

import hyper_parallel.distributed.checkpoint_names as checkpoint_names
from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.checkpoint_names import StoredTensor, conversion_transforms, route_checkpoint
from hyper_parallel.distributed.sharded_load import load_sharded_safetensors
from tests.launch import assert_ran, torchrun
from tests.project_fixtures import REPO

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SOURCE_MODULE = "transformers.models.mixtral.modeling_mixtral"
EXPERTS = 4


def mixtral_config(**overrides) -> transformers.MixtralConfig:
    """A tiny Mixtral: 2 layers, 4 experts, GQA; sizes divisible by 2 everywhere."""
    return transformers.MixtralConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_local_experts=EXPERTS, num_experts_per_tok=2, vocab_size=256,
                                      **overrides)


def save_mixtral(model_dir: Path, **overrides) -> Path:
    """A random Mixtral written by ``save_pretrained`` (transformers' real saved names)."""
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(mixtral_config(**overrides), dtype=torch.float32)
    model.save_pretrained(model_dir)
    return model_dir


def saved_keys(model_dir: Path) -> list[str]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
        return list(handle.keys())


# --- lazy reads: transformers' operations recorded, read by slices -----------------------------------


@pytest.fixture
def stored(tmp_path):
    """Four [6, 10] tensors in a safetensors file, opened lazily, and their values."""
    torch.manual_seed(0)
    values = {f"t{i}": torch.randn(6, 10) for i in range(4)}
    save_file(values, str(tmp_path / "t.safetensors"))
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as handle:
        yield {name: StoredTensor(handle, name) for name in values}, values


def _select(tensor: torch.Tensor, segments) -> torch.Tensor:
    """The reference selection: per dimension, the ranges concatenated in order."""
    for dim, ranges in enumerate(segments):
        tensor = torch.cat([tensor.narrow(dim, lo, hi - lo) for lo, hi in ranges], dim=dim)
    return tensor


@pytest.mark.parametrize("expression", ["stack_cat", "cat_transpose", "chunk", "split"])
def test_recorded_operations_read_the_same_slices_as_the_real_ones(stored, expression):
    lazy, real = stored

    def build(t):
        if expression == "stack_cat":  # MergeModulelist + Concatenate (gate_up_proj from per-expert tensors)
            return torch.cat([torch.stack([t["t0"], t["t1"]]), torch.stack([t["t2"], t["t3"]])], dim=1)
        if expression == "cat_transpose":
            return torch.transpose(torch.cat([t["t0"], t["t1"]], dim=0), 0, 1).contiguous()
        if expression == "chunk":  # Chunk: uneven pieces as torch gives them
            return torch.cat(torch.chunk(t["t0"], 4, dim=1)[1:], dim=1)
        return torch.split(t["t1"], [2, 1, 3], dim=0)[2]

    expected, recorded = build(real), build(lazy)
    assert tuple(recorded.shape) == tuple(expected.shape)
    shape = expected.shape
    choices = [[[(0, size)] for size in shape],
               [[(1, shape[0] - 1)]] + [[(0, 1), (2, size)] for size in shape[1:]],
               [[(0, 0)]] + [[(0, size)] for size in shape[1:]]]
    for segments in choices:
        assert torch.equal(recorded.read(segments), _select(expected, segments)), segments


def test_an_operation_that_cannot_be_recorded_raises(stored):
    lazy, _ = stored
    with pytest.raises(checkpoint_names.Unsliceable):
        torch.flip(lazy["t0"], dims=[0])
    with pytest.raises(AttributeError):
        lazy["t0"].reshape(60)


# --- names: transformers' mapping, not ours ---------------------------------------------------------


def test_mixtral_routes_come_from_transformers_conversion_mapping(tmp_path):
    model_dir = save_mixtral(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(mixtral_config())
    names = [name for name, _ in model.named_parameters()]
    routes = route_checkpoint(names, saved_keys(model_dir), conversion_transforms(model), model.base_model_prefix)

    assert routes.renamed["model.layers.1.mlp.gate.weight"] == "model.layers.1.block_sparse_moe.gate.weight"
    group = routes.groups["model.layers.1.mlp.experts.gate_up_proj"]
    prefix = "model.layers.1.block_sparse_moe.experts"
    assert group.source_keys() == [f"{prefix}.{e}.{w}.weight" for e in range(EXPERTS) for w in ("w1", "w3")]
    assert routes.groups["model.layers.1.mlp.experts.down_proj"].source_keys() == [
        f"{prefix}.{e}.w2.weight" for e in range(EXPERTS)]
    assert routes.unexpected == []


@pytest.mark.parametrize("tied", [False, True])
def test_mixtral_save_pretrained_loads_like_from_pretrained(tmp_path, tied):
    model_dir = save_mixtral(tmp_path, tie_word_embeddings=tied)
    assert ("lm_head.weight" in saved_keys(model_dir)) is not tied  # a tied weight is stored once
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_config(mixtral_config(tie_word_embeddings=tied),
                                                          dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    report = load_sharded_safetensors(model, model_dir)

    assert report.missing == [] and report.notes == []
    expected = reference.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_own_parameter_names_keep_loading_as_they_are(tmp_path):
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(mixtral_config(), dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    fresh = transformers.AutoModelForCausalLM.from_config(mixtral_config(), dtype=torch.float32)
    report = load_sharded_safetensors(fresh, tmp_path)

    assert report.missing == [] and report.notes == []
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_a_conversion_that_cannot_be_sliced_reads_whole_with_a_note(tmp_path, monkeypatch, caplog):
    """A converter with ``Interleave`` (which reshapes): its sources are read whole and
    transformers' operation runs on them; everything else still reads by slices."""
    torch.manual_seed(4)
    model = transformers.AutoModelForCausalLM.from_config(mixtral_config(), dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    interleave_back = Interleave(dim=0).reverse_op
    for layer in range(2):
        q = state.pop(f"model.layers.{layer}.self_attn.q_proj.weight")
        state[f"model.layers.{layer}.self_attn.wq.weight"] = interleave_back.convert({"q": q}, [], ["q"])["q"]
    save_file(state, str(tmp_path / "model.safetensors"))
    converter = WeightConverter("self_attn.wq.weight", "self_attn.q_proj.weight", operations=[Interleave(dim=0)])
    monkeypatch.setattr(checkpoint_names, "conversion_transforms", lambda *_a, **_k: [converter])

    fresh = transformers.AutoModelForCausalLM.from_config(mixtral_config(), dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="hyper_parallel"):
        report = load_sharded_safetensors(fresh, tmp_path)
    assert any("Interleave" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)

    assert len(report.notes) == 2 and all("reading its 1 source tensor(s) whole" in n for n in report.notes)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_a_split_into_several_parameters_is_recorded_not_read_whole(tmp_path, monkeypatch):
    """One checkpoint tensor, transformers' ``Split`` into q and k (one-to-many): both
    parameters come out of the same recorded converter, nothing is read whole."""
    torch.manual_seed(6)
    model = transformers.AutoModelForCausalLM.from_config(mixtral_config(), dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for layer in range(2):
        prefix = f"model.layers.{layer}.self_attn"
        state[f"{prefix}.qk_proj.weight"] = torch.cat([state.pop(f"{prefix}.q_proj.weight"),
                                                      state.pop(f"{prefix}.k_proj.weight")])
    save_file(state, str(tmp_path / "model.safetensors"))
    converter = WeightConverter("self_attn.qk_proj.weight", ["self_attn.q_proj.weight", "self_attn.k_proj.weight"],
                                operations=[Split(dim=0)])
    monkeypatch.setattr(checkpoint_names, "conversion_transforms", lambda *_a, **_k: [converter])

    fresh = transformers.AutoModelForCausalLM.from_config(mixtral_config(), dtype=torch.float32)
    report = load_sharded_safetensors(fresh, tmp_path)

    assert report.missing == [] and report.notes == []
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


# --- the gen path under torchrun: tp2 and dp2+ep2 in one launch --------------------------------------


def _emit_generated(out: Path, layout: str, dims) -> Path:
    """The modeling file codegen emits for the tiny Mixtral at ``dims`` (plan, freeze, emit)."""
    from hyper_parallel.codegen.emit.modeling import emit_modeling_source
    from hyper_parallel.codegen.plan.freeze import freeze_plan
    from hyper_parallel.distributed.plan_format import plan_modules_to_json
    from hyper_parallel.planning.planner import ShardingPlanner

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(mixtral_config())
    result = ShardingPlanner(model, Layout(dims)).plan()
    frozen = freeze_plan({"format": 2, "layout": Layout(dims).as_dict(),
                          "applied_axes": list(result.applied_axes), "recorded_axes": dict(result.recorded_axes),
                          "modules": plan_modules_to_json(result.modules, result.roles)},
                         [name for name, _ in model.named_modules()])
    source = Path(importlib.util.find_spec(SOURCE_MODULE).origin).read_text(encoding="utf-8")
    banner = {"recipe": f"recipes/mixtral_{layout}.yaml", "signature": "test", "source_sha256": "test",
              "transformers_version": transformers.__version__, "parallel_dims": dataclasses.asdict(dims)}
    path = out / f"modeling_Mixtral_gen_cpu_{layout}.py"
    path.write_text(emit_modeling_source(source_text=source, source_module=SOURCE_MODULE, banner=banner,
                                         frozen_plan=frozen), encoding="utf-8")
    return path


def test_mixtral_save_pretrained_loads_in_the_gen_path_at_tp2_and_dp2_ep2(tmp_path):
    from tests.distributed.checkpoint_conversion_worker import LAYOUTS

    model_dir = save_mixtral(tmp_path / "model")
    cases = [f"{layout}={_emit_generated(tmp_path, layout, dims)}" for layout, dims in LAYOUTS.items()]
    proc = torchrun(["-m", "tests.distributed.checkpoint_conversion_worker", "--model-dir", str(model_dir),
                     "--out", str(tmp_path), *[arg for case in cases for arg in ("--case", case)]], cwd=REPO)
    assert_ran(proc)

    held_by_rank = []
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for layout, result in results.items():
            assert not result["class_module"].startswith("transformers."), result["class_module"]
            # every local piece is exactly from_pretrained's same piece; nothing missing, nothing read whole
            assert result["mismatches"] == [] and result["missing"] == [] and result["notes"] == [], (layout, result)
            # each byte read is a byte kept: tp slices and expert slices only
            assert result["bytes_read"] == result["local_bytes"], (layout, result)
            assert result["local_bytes"] < result["full_bytes"], (layout, result)
            read = {tuple(entry) for entry in result["experts_read"]}
            expected = {(layer, e, w) for layer in range(result["layers"]) for e in result["held_experts"]
                        for w in ("w1", "w2", "w3")}
            assert read == expected, (layout, sorted(read ^ expected))
        assert results["tp2"]["held_experts"] == list(range(EXPERTS))
        held_by_rank.append(results["dp2_ep2"]["held_experts"])
    assert held_by_rank == [[0, 1], [2, 3]]
