"""The resolver finds the file that defines the causal-LM class transformers builds for a
model_type, for every type in transformers' causal-LM mapping (``gemma3_text`` lives in
``gemma3``, ``exaone`` is ``LlamaForCausalLM``, ``gpt-sw3`` is GPT-2), without importing
transformers; an unknown type keeps its one-line refusal."""

import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from transformers.models.auto.configuration_auto import model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hyper_parallel.codegen.source import resolver
from hyper_parallel.codegen.source.resolver import SourceError, modeling_path
from tests.families.family_cases import generate_tp2
from tests.project_fixtures import REPO

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# Types whose modeling file is not models/<type>/modeling_<type>.py (refused before).
NOT_BY_NAME = {
    "gemma3_text": "transformers.models.gemma3.modeling_gemma3",
    "gemma3n_text": "transformers.models.gemma3n.modeling_gemma3n",
    "llama4_text": "transformers.models.llama4.modeling_llama4",
    "exaone": "transformers.models.llama.modeling_llama",
    "internlm3": "transformers.models.llama.modeling_llama",
    "gpt-sw3": "transformers.models.gpt2.modeling_gpt2",
    "openai-gpt": "transformers.models.openai.modeling_openai",
}


def _defining_file(class_name: str) -> tuple[str, Path]:
    """What importing transformers says: the class's module and source file."""
    cls = getattr(transformers, class_name)
    return cls.__module__, Path(inspect.getsourcefile(cls))


def test_every_causal_lm_type_resolves_to_the_file_defining_its_class():
    tables = resolver.auto_tables()
    assert tables.causal_lm == dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    wrong = {}
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        assert tables.module_name(model_type) == model_type_to_module_name(model_type), model_type
        got, want = modeling_path(model_type), _defining_file(class_name)
        if got != want:
            wrong[model_type] = (got, want)
    assert wrong == {}
    for model_type, module in NOT_BY_NAME.items():
        assert modeling_path(model_type)[0] == module, model_type


def test_resolving_imports_neither_torch_nor_transformers():
    code = ("import sys; from hyper_parallel.codegen.source.resolver import hash_source, locate_model_source; "
            "source = hash_source(locate_model_source('gemma3_text')); "
            "assert source.file == 'models/gemma3/modeling_gemma3.py', source; "
            "assert not {'torch', 'transformers'} & set(sys.modules), 'imported torch or transformers'")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_a_class_no_mapped_package_defines_is_found_among_all_packages(monkeypatch):
    # transformers falls back to its top level, which exports every model package's __all__
    tables = resolver.auto_tables()
    fake = dataclasses.replace(tables, causal_lm={**tables.causal_lm, "hp_alias": "Gemma3TextModel",
                                                  "hp_nowhere": "NoSuchForCausalLM"})
    monkeypatch.setattr(resolver, "auto_tables", lambda: fake)
    assert modeling_path("hp_alias")[0] == "transformers.models.gemma3.modeling_gemma3"
    with pytest.raises(SourceError, match=r"model_type 'hp_nowhere': transformers \S+ maps it to NoSuchForCausalLM "
                                          r"\(models/auto/modeling_auto.py MODEL_FOR_CAUSAL_LM_MAPPING_NAMES\), "
                                          r"but no file under models/ defines class NoSuchForCausalLM"):
        modeling_path("hp_nowhere")


def test_unknown_and_non_causal_types_are_refused_by_name():
    with pytest.raises(SourceError, match=r"unknown model_type 'no_such_model': transformers \S+ has no "
                                          r"models/no_such_model/modeling_no_such_model.py"):
        modeling_path("no_such_model")
    with pytest.raises(SourceError, match=r"model_type 't5': transformers \S+ has models/t5/modeling_t5.py but "
                                          r"maps no causal-LM class to it"):
        modeling_path("t5")


def test_a_type_outside_its_own_folder_generates(tmp_path):
    """exaone (LlamaForCausalLM, no modeling_exaone.py) goes through every stage at tp2."""
    def exaone(folder):
        transformers.AutoConfig.for_model(
            "exaone", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=256, num_layers=2, max_position_embeddings=128, use_cache=False, bos_token_id=1,
            eos_token_id=2, pad_token_id=0).save_pretrained(folder)

    recipe, out = generate_tp2(tmp_path / "project", "exaone", exaone)
    assert "source transformers.models.llama.modeling_llama" in out, out[-4000:]
    assert "[verify] ok: world 2 (torchrun)" in out, out[-4000:]
    bundle = recipe.parent / "generated"
    assert "class LlamaForCausalLM(" in (bundle / "modeling_Exaone_gen_cpu.py").read_text()
