"""resolve for remote code: a model folder whose config.json maps AutoModelForCausalLM
in auto_map is its own source; its sibling .py files are part of the source identity
(and so of every signature); imports of siblings stay relative in the generated file."""

import json
import shutil

import pytest

from hyper_parallel.codegen.astkit import SourceModule, apply_text_edits
from hyper_parallel.runtime.integrity import bundle_file_problems
from hyper_parallel.codegen.emit.imports import RemoteCode, remote_import_edits
from hyper_parallel.codegen.hash import canonical_json, sha256_file
from hyper_parallel.codegen.manager import load_spec
from hyper_parallel.codegen.source.resolver import (
    SourceError,
    hash_source,
    locate_source,
    read_model_config,
    sibling_files,
    source_text,
    transformers_version,
)
from hyper_parallel.codegen.spec.project import signature_from_spec, stage_signature
from tests.remote_code.remote_project import MODEL_DATA, MODEL_DIR, RECIPE, SIBLING, make_remote_project


def _resolve(model_dir):
    return hash_source(locate_source(model_dir, read_model_config(model_dir, recipe="test", key="model")))


def _copy_model(tmp_path):
    model_dir = tmp_path / "fused_decoder"
    shutil.copytree(MODEL_DATA, model_dir, ignore=shutil.ignore_patterns("__pycache__"))
    return model_dir


def test_remote_source_identity_names_files_relative_to_the_model_folder(tmp_path):
    model_dir = _copy_model(tmp_path)
    source = _resolve(model_dir)
    assert (source.origin, source.module, source.file) == ("remote", "modeling_fused", "modeling_fused.py")
    assert source.model_type == "hp_fused_decoder"
    assert source.sha256 == sha256_file(model_dir / "modeling_fused.py")
    assert source.siblings == ((SIBLING, sha256_file(model_dir / SIBLING)),)
    assert source.transformers_version == transformers_version()
    identity = canonical_json(source.identity())
    assert str(tmp_path) not in identity and "/" not in source.file
    assert source_text(source, model_dir) == (model_dir / "modeling_fused.py").read_text()
    assert sibling_files(source, model_dir) == {SIBLING: (model_dir / SIBLING).read_bytes()}


def test_a_config_without_auto_map_resolves_into_transformers():
    source = hash_source(locate_source(MODEL_DATA, {"model_type": "qwen3_moe"}))
    assert (source.origin, source.module, source.siblings) == (
        "transformers", "transformers.models.qwen3_moe.modeling_qwen3_moe", ())
    assert source.file == "models/qwen3_moe/modeling_qwen3_moe.py"


@pytest.mark.parametrize("reference, expected", [
    ("someorg/repo--modeling_fused.FusedDecoderForCausalLM", "expected 'module.Class' naming a file"),
    ("FusedDecoderForCausalLM", "expected 'module.Class' with the module a .py file"),
    ("modeling_missing.FusedDecoderForCausalLM", "names module 'modeling_missing', but"),
])
def test_bad_auto_map_entries_name_the_key(tmp_path, reference, expected):
    model_dir = _copy_model(tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"]["AutoModelForCausalLM"] = reference
    with pytest.raises(SourceError) as err:
        locate_source(model_dir, config)
    message = str(err.value)
    assert "config.json" in message and "auto_map.AutoModelForCausalLM" in message, message
    assert expected in message, message


def test_changed_sibling_fails_reading_and_changes_every_signature(tmp_path):
    project = make_remote_project(tmp_path / "project")
    spec = load_spec(project / RECIPE, project / "generated")
    before = {"bundle": signature_from_spec(spec), "resolve": stage_signature(spec, "resolve", {})}
    sibling = project / MODEL_DIR / SIBLING
    sibling.write_text(sibling.read_text() + "\n# a comment changes the bytes\n")
    with pytest.raises(SourceError, match=f"{SIBLING}: changed since it was resolved"):
        sibling_files(spec.source, spec.model_dir)
    changed = load_spec(project / RECIPE, project / "generated")
    assert signature_from_spec(changed) != before["bundle"]
    assert stage_signature(changed, "resolve", {}) != before["resolve"]
    assert str(project) not in canonical_json(changed.source.identity())


SOURCE = '''\
"""doc"""
from . import configuration_fused
from .configuration_fused import FusedConfig  # sibling: stays relative
from ...activations import ACT2FN
from ...modeling_utils import (
    PreTrainedModel,  # the names and their layout stay
)
'''


def test_sibling_imports_stay_relative_others_become_transformers_paths():
    source = SourceModule.parse(SOURCE, "modeling_fused")
    remote = RemoteCode("hp_fused_decoder", ("configuration_fused",))
    edited = apply_text_edits(SOURCE, remote_import_edits(source, remote))
    assert edited == SOURCE.replace("from ...activations", "from transformers.activations").replace(
        "from ...modeling_utils", "from transformers.modeling_utils")


@pytest.mark.parametrize("line", ["from .modeling_llama import LlamaMLP", "from ...no_such_module import X"])
def test_relative_import_of_neither_sibling_nor_transformers_fails_naming_the_line(line):
    text = f'"""doc"""\nimport torch\n{line}\n'
    source = SourceModule.parse(text, "modeling_fused")
    with pytest.raises(ValueError) as err:
        remote_import_edits(source, RemoteCode("hp_fused_decoder", ("configuration_fused",)))
    message = str(err.value)
    assert message.startswith("modeling_fused:3: relative import"), message
    assert "configuration_fused" in message and "nor a transformers module" in message, message


def test_drift_requires_every_sibling_in_the_bundle(tmp_path):
    (tmp_path / "modeling.py").write_text("x = 1\n")
    meta = {"source": {"file": "modeling_fused.py", "siblings": [[SIBLING, "0" * 64]]},
            "outputs": {"modeling.py": sha256_file(tmp_path / "modeling.py")}}
    problems = bundle_file_problems(tmp_path, meta)
    assert problems == [f"{tmp_path / 'codegen_meta.json'}: outputs: remote-code sibling {SIBLING} of "
                        f"modeling_fused.py is not part of the bundle"]
    (tmp_path / SIBLING).write_text("y = 2\n")
    meta["outputs"][SIBLING] = sha256_file(tmp_path / SIBLING)
    assert "expected the sha256 resolved from the model folder" in bundle_file_problems(tmp_path, meta)[0]
