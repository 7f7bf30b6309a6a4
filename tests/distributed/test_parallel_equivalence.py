"""torchrun on CPU (gloo): every parallel form the planner applies, on tiny qwen3_moe,
equals the single-process HF model — first loss (rtol 1e-5), every gathered gradient
(rtol 1e-4, atol 1e-6), and the losses of three AdamW steps."""

import math
import subprocess

import pytest

from tests.batch_launch import Batches
from tests.distributed.test_tp_equivalence import CONFIG_DIR, REPO, _save_random_weights
from tests.launch import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# id: (world size, worker flags, applied axes, local logits shape for a [2, 12] batch,
#      local shape of an experts down_proj [experts, hidden, intermediate])
FORMS = {
    "tp2_sp": (2, ["--tp", "2", "--sp"], ["tp", "sp"], [2, 12, 256], [4, 64, 16]),
    "tp2_sp_loss_parallel": (2, ["--tp", "2", "--sp", "--loss-parallel"], ["tp", "loss_parallel", "sp"],
                             [2, 12, 128], [4, 64, 16]),
    "ep2_cp2": (2, ["--tp", "1", "--cp", "2", "--ep", "2"], ["cp", "ep"], [2, 6, 256], [2, 64, 32]),
    "cp2": (2, ["--tp", "1", "--cp", "2"], ["cp"], [2, 6, 256], [4, 64, 32]),
    "dp2_fsdp2": (2, ["--tp", "1", "--dp", "2"], [], [1, 12, 256], [4, 64, 32]),
    "tp2_cp2_ep2": (4, ["--tp", "2", "--cp", "2", "--ep", "2"], ["tp", "cp", "ep"], [2, 6, 256], [2, 64, 16]),
}
FULL_LOGITS = ([2, 12, 256], [1, 12, 256])


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "weights.safetensors"
    _save_random_weights(path)
    return path


def launch_worker(world: int, flags: list[str], weights, out, timeout: float = 300) -> subprocess.CompletedProcess:
    return torchrun(["-m", "tests.distributed.tp_equivalence_worker",
                     "--config-dir", str(CONFIG_DIR), "--weights", str(weights), "--out", str(out), *flags],
                    cwd=REPO, nproc=world, timeout=timeout)


@pytest.fixture(scope="module")
def batches(weights, tmp_path_factory):
    """One torchrun launch per world size runs every form of that size in turn, in the
    same ranks (tests/batch_launch.py): rank start-up (python, torch, transformers) once
    per launch, not once per form. Each test reads its own form's per-rank results, so a
    failure names the form."""
    def launch(world: int, out, cases) -> subprocess.CompletedProcess:
        return launch_worker(world, ["--cases", str(cases)], weights, out, timeout=600)

    return Batches(tmp_path_factory.mktemp("forms"), {name: form[:2] for name, form in FORMS.items()}, launch)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_parallel_form_matches_single_process(form, batches):
    world, flags, applied, logits_shape, expert_shape = FORMS[form]
    for result in batches.results(form):
        assert result["applied_axes"] == applied
        # the form really splits what it says (fsdp2: the shard is gathered for compute)
        assert result["local_logits_shape"] == logits_shape
        assert result["expert_local_shape"] == expert_shape or form == "dp2_fsdp2"
        assert result["sharded_loss"] == (logits_shape not in FULL_LOGITS)
        assert math.isclose(result["par_loss"], result["ref_loss"], rel_tol=1e-5), result
        assert result["grad_failures"] == [], result["grad_failures"]
        assert result["grads_checked"] == result["param_count"] == 25
        # FSDP2 shards every parameter; otherwise a parameter is a DTensor only where the
        # plan places it on an axis of more than one rank (a replicated norm with whole
        # inputs, or anything under a tp of one rank, stays a plain tensor)
        if form == "dp2_fsdp2":
            assert result["dtensor_params"] == 25
        else:
            assert 0 < result["dtensor_params"] <= 25, result
        assert result["meta_shape_mismatches"] == []
        ref, par = result["losses"]["reference"], result["losses"]["parallel"]
        assert len(par) == 3 and par[2] < par[0]  # the steps did something
        for ours, theirs in zip(par, ref):
            assert math.isclose(ours, theirs, rel_tol=1e-5), (par, ref)


def test_sequence_not_divisible_by_cp_times_tp_fails_naming_module_and_sizes(weights, tmp_path):
    run = launch_worker(2, ["--tp", "2", "--sp", "--seq-len", "13"], weights, tmp_path)
    assert run.returncode != 0
    assert ("model.layers.0 input 0: dim 1 (sequence length 13) of a tensor of shape [2, 13, 64] must be "
            "divisible by tp=2, over which the plan splits it") in run.stderr + run.stdout
