"""The resolve stage does the resolving (issue 13): projecting a recipe locates the model
source without reading it; the resolve stage (its up-to-date check or its run) hashes it,
once per spec, and records what every later signature names."""

import json

from hyper_parallel.codegen.manager import clean_recipe, load_spec
from hyper_parallel.codegen.source import resolver
from hyper_parallel.codegen.spec import types
from hyper_parallel.codegen.stages import StageFiles, run_stage, stage_is_current
from tests.project_fixtures import TINY_RECIPE


def test_the_projection_locates_and_resolve_hashes(project, monkeypatch):
    hashed = []
    monkeypatch.setattr(types, "hash_source", lambda location: hashed.append(location) or
                        resolver.hash_source(location))
    spec = load_spec(project / TINY_RECIPE, project / "generated")
    assert hashed == []  # the projection only located it
    assert spec.location.file == "models/qwen3_moe/modeling_qwen3_moe.py" and spec.location.path.is_file()

    assert not stage_is_current(spec, "resolve")  # the check resolves: it must see a changed source
    assert len(hashed) == 1
    run_stage(spec, "resolve")
    assert stage_is_current(spec, "resolve") and len(hashed) == 1  # one source per spec
    record = json.loads(StageFiles(spec).output("resolve").read_text())
    expected = resolver.hash_source(resolver.locate_source(spec.model_dir, spec.model_config)).identity()
    assert record["source"] == json.loads(json.dumps(expected))
    assert record["source"]["sha256"] == resolver.sha256_bytes(spec.location.path.read_bytes())


def test_clean_needs_no_resolved_source(project, monkeypatch):
    spec = load_spec(project / TINY_RECIPE, project / "generated")
    run_stage(spec, "resolve")
    fresh = load_spec(project / TINY_RECIPE, project / "generated")
    monkeypatch.setattr(types, "hash_source", lambda location: (_ for _ in ()).throw(AssertionError("hashed")))
    clean_recipe(fresh)
    assert not fresh.workspace.exists()
