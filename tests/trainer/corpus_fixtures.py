"""A small real corpus for the tokenized-dataset tests: documents of varied lengths, a
word-level tokenizer trained on them (``tokenizers``) and saved into a tiny model folder
as ``PreTrainedTokenizerFast``, and recipes that train on them with the hf backend (the
runtime planner, no codegen run)."""

import json
import shutil
from pathlib import Path

import yaml

from tests.project_fixtures import REPO, TINY_RECIPE

TINY_MODEL = REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"
EOS = "<eos>"
# 30 documents of 3 to 14 words (whitespace tokens), so rows of 12 tokens cross documents.
DOCUMENTS = [" ".join(f"w{(i * 7 + j * 3) % 40}" for j in range(3 + (i * 5) % 12)) + f" end{i % 3}"
             for i in range(30)]


def save_tokenizer(model_dir: Path, documents: list[str] = DOCUMENTS) -> None:
    """A word-level tokenizer (whitespace split, ``<unk>`` and ``<eos>`` first) trained on
    ``documents``, saved into ``model_dir`` as transformers saves any fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(documents, trainers.WordLevelTrainer(special_tokens=["<unk>", EOS]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, unk_token="<unk>").save_pretrained(model_dir)


def model_with_tokenizer(dest: Path) -> Path:
    """The tiny Qwen3-MoE folder (config.json) copied to ``dest`` with the corpus' tokenizer."""
    shutil.copytree(TINY_MODEL, dest)
    save_tokenizer(dest)
    return dest


def write_jsonl(path: Path, documents: list[str] = DOCUMENTS, column: str = "text") -> Path:
    """One JSON object per document, with an extra field a reader must ignore."""
    path.write_text("".join(json.dumps({"id": i, column: text}) + "\n" for i, text in enumerate(documents)))
    return path


def corpus_recipe(folder: Path, dataset: dict, *, dp: int = 2, tp: int = 1, training: dict | None = None,
                  config_overrides: dict | None = None) -> Path:
    """The tiny recipe in ``folder`` (model under ``folder/model``) on ``dataset``, built
    with the hf backend: no bundle to generate, the same model the gen backend trains."""
    data = yaml.safe_load((REPO / TINY_RECIPE).read_text())
    data["model"]["pretrained_model_name_or_path"] = "model"
    if config_overrides:
        data["model"]["config_overrides"] = config_overrides
    data["codegen"] = False
    data["modeling_backend"] = "hf"
    data["accelerator"].update(nproc_per_node=dp * tp, dp_size=dp, tp_size=tp)
    data["training"].update({"steps": 4, "global_batch_size": 4, "micro_batch_size": 1, "seq_len": 12,
                             **(training or {})})
    data["dataset"] = dataset
    recipe = folder / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    return recipe


BAD_DATASETS = {
    # case: (dataset, what to break, the error line after "error: <recipe>: ", up to its details)
    "missing_file": ({"kind": "jsonl", "path": "absent.jsonl"}, None,
                     "dataset.path: {folder}/absent.jsonl does not exist"),
    "no_tokenizer": ({"kind": "jsonl", "path": "corpus.jsonl"}, "tokenizer",
                     "model.pretrained_model_name_or_path: {folder}/model has no tokenizer"),
    "empty_dataset": ({"kind": "jsonl", "path": "empty.jsonl"}, None,
                      "dataset.path: {folder}/empty.jsonl holds no documents"),
    "column_missing": ({"kind": "jsonl", "path": "corpus.jsonl", "text_column": "body"}, None,
                       "dataset.text_column: {folder}/corpus.jsonl has no column 'body' (its columns: id, text)"),
}


def bad_dataset_folder(folder: Path, broken: str | None) -> Path:
    """The model (without its tokenizer when ``broken`` says so), corpus.jsonl and an empty
    empty.jsonl in ``folder``."""
    folder.mkdir(parents=True)
    model_with_tokenizer(folder / "model")
    if broken == "tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (folder / "model" / name).unlink()
    write_jsonl(folder / "corpus.jsonl")
    (folder / "empty.jsonl").write_text("")
    return folder
