"""verify's two ways to run ranks agree: torchrun processes and threads of one process
(the mode above the process cap), on the tiny recipe, at world 4 with tp, cp, ep,
sequence and loss parallel, and at dp2+ep2 with FSDP2; and the verified figures reach codegen_meta.json."""

import pytest
import yaml

from tests.project_fixtures import TINY_RECIPE, verify_in_both_modes

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# Layouts where the two modes could part: world 4 over four axes, and FSDP2's own gradient
# division (plain tp2 verifies as torchrun in every generate of the tiny project and as
# threads in the family subset).
LAYOUTS = {
    "tp2_cp2_ep2_sp_lp": {"nproc_per_node": 4, "tp_size": 2, "cp_size": 2, "ep_size": 2,
                          "sequence_parallel": True, "loss_parallel": True},
    # FSDP2 over dp with experts over ep on one-rank edp groups: FSDP2 divides by the
    # gradient divide factor itself there (threads must not force a second division).
    "dp2_ep2_fsdp2": {"nproc_per_node": 2, "dp_size": 2, "tp_size": 1, "ep_size": 2},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_threads_and_torchrun_give_the_same_verdict_and_figures(project, layout):
    recipe = project / TINY_RECIPE
    data = yaml.safe_load(recipe.read_text())
    data["accelerator"].update(LAYOUTS[layout])
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    world = data["accelerator"]["nproc_per_node"]
    verified = {}
    for mode, (_, report, recorded) in verify_in_both_modes(project, recipe).items():
        assert recorded == {"mode": mode, "world": world, "steps": 2}
        verified[mode] = report
    torchrun, threads = verified["torchrun"], verified["threads"]
    assert torchrun["max_loss_rel"] <= 1e-5 and torchrun["max_grad_rel"] <= 1e-4
    # Same collectives on the same data: the same figures up to reduction order.
    for key in ("max_loss_rel", "max_grad_rel"):
        assert abs(torchrun[key] - threads[key]) <= 1e-5, (torchrun, threads)
