"""Pipeline parallel trains exactly like one process: the tiny Qwen3-MoE recipe (gen
backend, 2 decoder layers: one per stage) under torchrun, each step's loss and every
parameter's gradient of 3 AdamW steps equal to single-process HF training on the same
weights and micro-batches (fp32; loss rtol 1e-5, gradients rtol 1e-4). Composed with tp,
FSDP2 over dp, and ep over the dp ranks of each stage."""

import pytest
import torch
import transformers
import yaml
from safetensors.torch import save_file

from hyper_parallel.codegen.check.verify_mode import MAX_PROCS_ENV
from hyper_parallel.trainer.reference import reference_training
from tests.launch import assert_ran, torchrun
from tests.project_fixtures import REPO, TINY_RECIPE

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 3
QWEN3_MOE_MODELING = "transformers.models.qwen3_moe.modeling_qwen3_moe"

LAYOUTS = {
    "pp2_1f1b": {"nproc_per_node": 2, "pp_size": 2, "tp_size": 1},
    "pp2_tp2_gpipe": {"nproc_per_node": 4, "pp_size": 2, "tp_size": 2, "pipeline": {"schedule": "gpipe"}},
    "pp2_dp2_fsdp2": {"nproc_per_node": 4, "pp_size": 2, "dp_size": 2, "tp_size": 1},
    "pp2_dp2_ep2": {"nproc_per_node": 4, "pp_size": 2, "dp_size": 2, "tp_size": 1, "ep_size": 2},
    "pp2_tp2_lp": {"nproc_per_node": 4, "pp_size": 2, "tp_size": 2, "loss_parallel": True},
}


def _recipe(project, layout: str):
    recipe = project / TINY_RECIPE
    data = yaml.safe_load(recipe.read_text())
    data["accelerator"].update(LAYOUTS[layout])
    data["model"]["init"] = "pretrained"
    data["training"].update(steps=STEPS, global_batch_size=4, micro_batch_size=1, seq_len=12)
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    model_dir = recipe.parent / data["model"]["pretrained_model_name_or_path"]
    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(2024)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(model_dir / "model.safetensors"))
    return recipe


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pipeline_training_matches_one_process_in_loss_and_every_gradient(project, tmp_path, layout):
    recipe = _recipe(project, layout)
    world = LAYOUTS[layout]["nproc_per_node"]
    out = tmp_path / "ranks"
    proc = torchrun(["-m", "tests.trainer.pipeline_worker", "--recipe", str(recipe), "--steps", str(STEPS),
                     "--out", str(out)], REPO, nproc=world, preload=(QWEN3_MOE_MODELING,),
                    env={MAX_PROCS_ENV: "1", "HYPER_PARALLEL_WORKSPACE": str(project / "generated")})
    assert_ran(proc)
    # the bundle's plan records the split the stages ran (and the review diff shows it)
    modeling = "".join(path.read_text() for path in (recipe.parent / "generated").glob("modeling_*.py"))
    assert '"pipeline": {"stages": [[0, 1], [1, 2]]},' in modeling
    ranks = [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)]
    reference = reference_training(recipe, gradients=True)  # one process, the whole HF model
    want_losses, want_grads = [r["loss"] for r in reference], [r["grads"] for r in reference]
    # the stages split the layers and hold each parameter once between them
    stages = sorted({rank["stage"] for rank in ranks})
    assert stages == [(0, 0, 1), (1, 1, 2)], stages
    held = {}
    for rank in ranks:
        for name in rank["grads"][0]:
            held.setdefault(name, set()).add(rank["stage"][0])
    assert set(held) == set(want_grads[0]), set(want_grads[0]) ^ set(held)
    assert all(len(on) == 1 for on in held.values()), {name: on for name, on in held.items() if len(on) > 1}
    for rank in ranks:
        for step in range(STEPS):
            assert abs(rank["losses"][step] - want_losses[step]) <= 1e-5 * abs(want_losses[step]), (
                step, rank["losses"], want_losses)
            for name, got in rank["grads"][step].items():
                want = want_grads[step][name]
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), (
                    layout, step, name, (got - want).abs().max().item())
