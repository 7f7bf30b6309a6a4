"""``trainer export``: a checkpoint written as an HF model folder that
``AutoModelForCausalLM.from_pretrained`` loads with the trained weights (here: a DCP
checkpoint of one process; tests/trainer/test_checkpoint_reshard.py exports a tp2
checkpoint under torchrun, packed blocks and one file set per rank)."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from safetensors import safe_open

from hyper_parallel.config import load_training_config
from hyper_parallel.distributed.weight_map import saved_layout
from hyper_parallel.models.hf.backend import custom_model_module
from hyper_parallel.models.hf.model_builder import build_custom_model, hf_source_model
from hyper_parallel.trainer.export import ExportError, export_checkpoint, write_export_info
from tests.project_fixtures import REPO, TINY_RECIPE

pytestmark = pytest.mark.slow

CONFIG_DIR = REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"


def exported_keys(out) -> set[str]:
    """The tensor names the exported files hold."""
    keys = set()
    for file in sorted(out.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            keys.update(handle.keys())
    return keys


def test_a_checkpoint_exports_with_hf_names_and_loads_with_the_same_logits(tmp_path):
    config = transformers.AutoConfig.from_pretrained(CONFIG_DIR)
    torch.manual_seed(7)
    trained = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    step = tmp_path / "step_2"
    dcp.save({"model": trained.state_dict()}, checkpoint_id=str(step), no_dist=True)
    write_export_info(step, trained)

    export_checkpoint(step, tmp_path / "hf", max_shard_bytes=64 << 10)  # several files

    out = tmp_path / "hf"
    assert len(list(out.glob("model-rank000-*.safetensors"))) > 1
    assert exported_keys(out) == set(saved_layout(trained))  # per-expert gate/up/down, as save_pretrained writes
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == exported_keys(out)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trained(input_ids=ids).logits)


def test_a_checkpoint_without_export_info_is_one_line(tmp_path):
    with pytest.raises(ExportError, match="no hf/config.json"):
        export_checkpoint(tmp_path, tmp_path / "hf")


def test_a_custom_backend_checkpoint_exports_to_the_hf_layout(tmp_path):
    """The custom backend's model (models/common names, fused experts) carries its HF
    config and the weight map from the HF layout; the export inverts that map."""
    config = load_training_config(REPO / TINY_RECIPE)
    hf_config = transformers.AutoConfig.from_pretrained(CONFIG_DIR)
    torch.manual_seed(7)
    trained = build_custom_model(custom_model_module("qwen3_moe"), hf_config, config, with_weights=False)
    assert "layers.0.moe.experts.gate_up_proj" in trained.state_dict()
    step = tmp_path / "step_2"
    dcp.save({"model": trained.state_dict()}, checkpoint_id=str(step), no_dist=True)
    write_export_info(step, trained)

    export_checkpoint(step, tmp_path / "hf")

    out = tmp_path / "hf"
    assert exported_keys(out) == set(saved_layout(hf_source_model(hf_config)))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32,
                                                               experts_implementation="eager")
    ids = torch.randint(0, hf_config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trained(input_ids=ids).logits)


def _tiny_tokenizer(folder, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of at most ``vocab_size`` tokens, saved as transformers does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer=trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(folder)


def test_the_exported_folder_generates_text_through_a_pipeline(tmp_path):
    """Tokenizer files and a generation config come along (issue 56), and export warns of nothing."""
    import warnings

    config = transformers.AutoConfig.from_pretrained(CONFIG_DIR)
    source = tmp_path / "model"
    _tiny_tokenizer(source, config.vocab_size)
    torch.manual_seed(7)
    trained = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    step = tmp_path / "step_1"
    dcp.save({"model": trained.state_dict()}, checkpoint_id=str(step), no_dist=True)
    write_export_info(step, trained, source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_checkpoint(step, tmp_path / "hf")
    assert [str(w.message) for w in caught] == []
    out = tmp_path / "hf"
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    generate = transformers.pipeline("text-generation", model=str(out), device="cpu")
    text = generate("the quick", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("the quick") and len(text) > len("the quick"), text
