"""A family with tied embeddings (starcoder2: ``tie_word_embeddings`` true, so
``save_pretrained`` stores ``model.embed_tokens.weight`` and no ``lm_head.weight``) builds
with the gen backend's sharded loader, the head and the embedding one parameter, and trains
at tp2, cp2 and tp2+cp2 equal to single-process HF: loss rtol 1e-5 and gradient norm rtol
1e-4 every step. Under cp the one weight is used on the full sequence (the embedding) and on
each rank's piece (the head), so its gradient is a sum of a complete and a partial one.

The bundle rank 0 generates at start is verified as threads of one process (as in
tests/trainer/test_train_equivalence.py: training is under test here)."""

import math
import types
import warnings

import pytest
import torch
import transformers
import yaml
from safetensors import safe_open

from hyper_parallel.codegen.check.verify_mode import MAX_PROCS_ENV
from hyper_parallel.config import load_training_config
from hyper_parallel.models.hf.model_builder import build_generated_model_sharded
from hyper_parallel.trainer.reference import reference_training
from hyper_parallel.trainer.metrics import read_metrics
from tests.launch import assert_ran, torchrun
from tests.project_fixtures import REPO

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FAMILY = "starcoder2"
TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 256, "num_hidden_layers": 2, "max_position_embeddings": 128, "use_cache": False,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True}
STEPS, LOSS_RTOL, NORM_RTOL = 3, 1e-5, 1e-4


@pytest.fixture
def tied_recipe(tmp_path):
    """A throwaway project: dodo.py, a tiny starcoder2 checkpoint written by
    ``save_pretrained`` (its real tensor names) and a tp2 recipe for the gen backend."""
    project = tmp_path / "project"
    model_dir = project / "recipes" / FAMILY / "model"
    model_dir.mkdir(parents=True)
    (project / "dodo.py").write_bytes((REPO / "dodo.py").read_bytes())
    config = transformers.AutoConfig.for_model(FAMILY, **TINY)
    torch.manual_seed(1234)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
        model.save_pretrained(model_dir)
    recipe = project / "recipes" / FAMILY / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"pretrained_model_name_or_path": "model", "torch_dtype": "float32", "attn_implementation": "eager"},
        "accelerator": {"device_type": "cpu", "nproc_per_node": 2, "nnodes": 1, "tp_size": 2},
        "codegen": True,
        "training": {"steps": STEPS, "global_batch_size": 2, "micro_batch_size": 1, "seq_len": 16, "seed": 0},
        "optimizer": {"name": "adamw", "lr": 1.0e-3}}, sort_keys=False))
    return recipe


def _stored_names(model_dir) -> set[str]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
        return set(handle.keys())


def test_sharded_build_ties_the_head_to_the_stored_embedding(tied_recipe):
    """One process, no mesh (hyper_parallelize does nothing): the meta build, the tie and the
    materialization of plain parameters, which ``to_empty`` would otherwise split apart."""
    model_dir = tied_recipe.parent / "model"
    assert "lm_head.weight" not in _stored_names(model_dir)  # save_pretrained stores the tied head once
    config = load_training_config(str(tied_recipe))
    hf_config = transformers.AutoConfig.from_pretrained(model_dir)
    model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    bundle = types.SimpleNamespace(hyper_parallelize=lambda model, mesh: model)
    model = build_generated_model_sharded(model_class, hf_config, config, bundle, None)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.testing.assert_close(model.lm_head.weight, reference.model.embed_tokens.weight, rtol=0, atol=0)


# layout -> the recipe's accelerator sizes
LAYOUTS = {"tp2": {"tp_size": 2, "nproc_per_node": 2}, "cp2": {"cp_size": 2, "nproc_per_node": 2},
           "tp2_cp2": {"tp_size": 2, "cp_size": 2, "nproc_per_node": 4}}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tied_family_trains_like_one_process(tied_recipe, tmp_path, layout):
    data = yaml.safe_load(tied_recipe.read_text())
    data["accelerator"].pop("tp_size")
    data["accelerator"].update(LAYOUTS[layout])
    tied_recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    metrics = tmp_path / "metrics.json"
    world = LAYOUTS[layout]["nproc_per_node"]
    proc = torchrun(["-m", "hyper_parallel.trainer", "--config", str(tied_recipe), "--metrics", str(metrics)],
                    cwd=tied_recipe.parents[2], nproc=world, env={MAX_PROCS_ENV: "1"},
                    plain=True)  # as a user launches it: each rank a fresh interpreter
    assert_ran(proc)
    got, want = read_metrics(metrics), reference_training(tied_recipe)
    assert len(got) == len(want) == STEPS
    for step, (have, ref) in enumerate(zip(got, want), start=1):
        assert math.isclose(have["loss"], ref["loss"], rel_tol=LOSS_RTOL), (step, got, want)
        assert math.isclose(have["grad_norm"], ref["grad_norm"], rel_tol=NORM_RTOL), (step, got, want)
