"""HyperAutoModel.from_pretrained under torchrun (world 2, tp 2) with a mesh: the gen
backend (rank 0 generates the bundle, rank 1 waits; its hyper_parallelize shards the
model), the hf backend (runtime planner + applier) and the custom backend compute the
single-process HF model's loss, and gen/hf its gradients."""

import json
import math

import pytest

from tests.models.model_helpers import GROUPED_EXPERTS_FACTORY, save_random_hf_weights, tiny_project_recipe
from tests.launch import assert_ran, torchrun
from tests.project_fixtures import REPO

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

BACKENDS = ("gen", "hf", "custom")


def test_from_pretrained_with_a_tp2_mesh_equals_single_process_hf(tmp_path):
    recipe = tiny_project_recipe(tmp_path / "project", plan_overrides=[
        {"match": "*.mlp.experts", "replace_module": {"_target_": GROUPED_EXPERTS_FACTORY}}])
    recipe.write_text(recipe.read_text().replace("tp_size: 1", "tp_size: 2").replace("nproc_per_node: 1",
                                                                                     "nproc_per_node: 2"))
    save_random_hf_weights(recipe.parent / "models/tiny-qwen3-moe", seed=4321, recipe=recipe)

    proc = torchrun(["-m", "tests.models.auto_model_tp_worker",
                     "--recipe", str(recipe), "--workspace", str(tmp_path / "project/generated"),
                     "--out", str(tmp_path), "--backends", ",".join(BACKENDS)], cwd=REPO)
    assert_ran(proc)

    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for backend in BACKENDS:
            entry = result[backend]
            assert math.isclose(entry["loss"], result["ref_loss"], rel_tol=1e-5), (backend, result)
            assert entry["dtensor_params"] > 0, (backend, entry)  # it was sharded
        assert result["gen"]["class_module"].startswith("hyper_parallel_generated."), result
        assert result["hf"]["class_module"].startswith("transformers.models.qwen3_moe"), result
        assert result["custom"]["class_module"].startswith("hyper_parallel.models.common"), result
        for backend in ("gen", "hf"):
            assert result[backend]["experts"] == "GroupedQwen3MoeExperts", result[backend]
            assert result[backend]["grad_failures"] == [], result[backend]
            assert result[backend]["grads_checked"] == 25
