"""codegen_meta.json records the weight mapping (checkpoint name pattern → parameter
part), derived at generate time, and no longer lists it as not covered."""

import json

import pytest

from hyper_parallel.runtime.meta import META_FILE
from tests.pipeline.pipeline_helpers import generated_tiny_project
from tests.project_fixtures import TINY_RECIPE

pytestmark = [pytest.mark.slow]


def test_the_installed_meta_records_the_per_expert_weight_map(tmp_path_factory):
    project = generated_tiny_project(tmp_path_factory)
    meta = json.loads(((project / TINY_RECIPE).parent / "generated" / META_FILE).read_text())

    experts = "model.layers.*.mlp.experts"
    assert meta["weight_map"][f"{experts}.*.gate_proj.weight"] == f"{experts}.gate_up_proj[*, 0:32]"
    assert meta["weight_map"][f"{experts}.*.up_proj.weight"] == f"{experts}.gate_up_proj[*, 32:64]"
    assert meta["covered"]["weight_map"] is True
    assert not any("weight mapping" in line for line in meta["not_covered"])
