"""The existing equivalence matrix passes verify: the Qwen3-MoE layouts, and the HF families
at tp2 with sequence parallel, each generated through the verify stage at its world size.

Families whose full pipeline (generate through verify) the family subset already runs at
tp2 and cp2, and whose tp2-sp equivalence tests/families/test_families_tp.py checks on
the planner's own plan (llama, qwen3, mixtral, qwen2_moe), are not generated here again;
qwen2 is in neither, so it is."""

import shutil

import pytest
import yaml

from tests.project_fixtures import REPO, TINY_RECIPE, cli, verify_report

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FAMILY_CONFIGS = REPO / "tests/data/families"
QWEN3_MOE_LAYOUTS = {
    "qwen3_moe_tp2_sp_lp": {"tp_size": 2, "sequence_parallel": True, "loss_parallel": True},
    "qwen3_moe_cp2": {"tp_size": 1, "cp_size": 2},
    "qwen3_moe_cp2_ep2": {"tp_size": 1, "cp_size": 2, "ep_size": 2},
    "qwen3_moe_dp2_fsdp2": {"tp_size": 1, "dp_size": 2},
}
FAMILIES = ("qwen2",)
CASES = sorted([*QWEN3_MOE_LAYOUTS, *(f"{family}_tp2_sp" for family in FAMILIES)])


@pytest.mark.parametrize("case", CASES)
def test_layout_passes_verify(project, case):
    data = yaml.safe_load((project / TINY_RECIPE).read_text())
    folder = project / "recipes" / case  # its own folder: its own bundle
    if case in QWEN3_MOE_LAYOUTS:
        shutil.copytree(project / "recipes/tiny_cpu/models", folder / "models")
        data["accelerator"].update(QWEN3_MOE_LAYOUTS[case])
    else:
        family = case.removesuffix("_tp2_sp")
        shutil.copytree(FAMILY_CONFIGS / family, folder / "models" / family)
        data["model"]["pretrained_model_name_or_path"] = f"models/{family}"
        data["accelerator"].update(tp_size=2, sequence_parallel=True)
    recipe = folder / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))

    proc = cli(project, "--verbose", "generate", "--skip-preflight", "--config", str(recipe))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[verify] ok: world 2 (torchrun)" in out, out[-4000:]
    verified = verify_report(project, recipe)
    assert verified["world"] == 2 and verified["max_loss_rel"] <= 1e-5 and verified["max_grad_rel"] <= 1e-4
