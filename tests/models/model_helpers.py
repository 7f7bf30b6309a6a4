"""Shared by the tests of hyper_parallel.models: the tiny recipe in a throwaway project."""

from pathlib import Path

import torch
import transformers
import yaml

from tests.project_fixtures import REPO, TINY_RECIPE, make_project

TINY_MODEL_DIR = REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"
GROUPED_EXPERTS_FACTORY = "hyper_parallel.models.qwen3_moe.adapter.replacements.replace_qwen3_moe_grouped_experts"


def tiny_project_recipe(dest: Path, **changes) -> Path:
    """A copy of dodo.py + recipes/ in ``dest`` whose tiny recipe runs in one process
    (tp 1); ``changes`` replace top-level recipe keys. Returns the recipe path."""
    project = make_project(dest)
    recipe = project / TINY_RECIPE
    data = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    data["accelerator"].update(tp_size=1, nproc_per_node=1)
    data.update(changes)
    recipe.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return recipe


def save_random_hf_weights(model_dir: Path, seed: int = 0, *, recipe: Path):
    """An HF model with random weights, saved (safetensors) into ``model_dir``; returned.
    ``recipe`` (whose model folder it is) is set to load them (``model.init: pretrained``;
    the tiny recipe says ``random``: its folder ships no weights)."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.save_pretrained(model_dir)
    data = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    data["model"]["init"] = "pretrained"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return model


def token_batch(vocab_size: int, seed: int = 11) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
