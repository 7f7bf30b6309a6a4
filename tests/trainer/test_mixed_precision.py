"""Mixed precision (issue 28): float32 master weights, bf16 compute, float32 gradient
reduction, trained under torchrun at tp2, dp2 (FSDP2's MixedPrecisionPolicy) and
tp2+cp2+ep2 (autocast) against one process with the same policy
(hyper_parallel/trainer/reference.py: float32 parameters, autocast to bf16).

Tolerance: bf16 keeps 8 significant bits, so a rounded matmul output is off by up to
2^-9 of itself; a different split of the same matmul (tp shards, FSDP2 casting every
parameter where autocast casts matmul inputs only) rounds differently. Averaged over the
loss's elements that leaves about 2e-4 of the loss after 20 steps here (measured:
1.6e-4..2.0e-4 for the three layouts) and about 5e-3 of the gradient norm (one norm, no
averaging). LOSS_RTOL = 2e-3 and NORM_RTOL = 2e-2 are ten and four times that, and well
below the 0.8% the loss falls over the 20 steps or the factor a wrong gradient scale puts
on the norm. The runs are also checked to differ from float32 training: a policy that
silently computed in float32 would pass the tolerances without testing anything.
"""

import json
import math

import pytest
import torch
import transformers
import yaml
from safetensors.torch import save_file

from hyper_parallel.config import load_training_config
from hyper_parallel.models.hf.model_builder import build_hf_model
from hyper_parallel.runtime.recipe import Recipe
from hyper_parallel.trainer.data import global_batch
from hyper_parallel.trainer.metrics import read_metrics
from hyper_parallel.trainer.precision import compute_context
from hyper_parallel.trainer.reference import reference_training
from tests.launch import assert_ran, torchrun
from tests.project_fixtures import REPO, TINY_RECIPE, make_project

STEPS = 20
LOSS_RTOL = 2e-3
NORM_RTOL = 2e-2
QWEN3_MOE_MODELING = "transformers.models.qwen3_moe.modeling_qwen3_moe"

LAYOUTS = {  # name -> (world, accelerator keys)
    "tp2": (2, {"tp_size": 2}),
    "dp2_fsdp2": (2, {"dp_size": 2, "tp_size": 1}),
    "tp2_cp2_ep2": (4, {"tp_size": 2, "cp_size": 2, "ep_size": 2}),
}


def _save_weights(model_dir) -> None:
    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(2024)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(model_dir / "model.safetensors"))


def _recipe_text(project, layout: str, **training) -> str:
    data = yaml.safe_load((project / TINY_RECIPE).read_text())
    world, accelerator = LAYOUTS[layout]
    data["codegen"] = False
    data["modeling_backend"] = "hf"  # training is under test here, not generation
    data["model"]["torch_dtype"] = "bfloat16"
    data["model"]["init"] = "pretrained"  # the weights the fixture saves
    data["accelerator"].update(nproc_per_node=world, **accelerator)
    data["training"].update(steps=STEPS, global_batch_size=4, micro_batch_size=2, seq_len=12, **training)
    return yaml.safe_dump(data, sort_keys=False)


def _chain(project, tmp_path, world: int, layouts: list[str]) -> dict[str, tuple[list[dict], dict]]:
    """Each layout of ``world`` trained in turn in one launch (tests/trainer/train_chain_worker.py);
    per layout rank 0's metrics and the dtypes of its parameters and AdamW state."""
    runs = []
    for layout in layouts:
        recipe = (project / TINY_RECIPE).with_name(f"mp_{layout}.yaml")
        runs.append({"name": layout, "recipe": str(recipe), "text": _recipe_text(project, layout), "copies": [],
                     "metrics": str(tmp_path / f"{layout}.json"), "dtypes": str(tmp_path / f"{layout}.dtypes.json")})
    (tmp_path / f"chain{world}.json").write_text(json.dumps(runs))
    proc = torchrun(["-m", "tests.trainer.train_chain_worker", "--chain", str(tmp_path / f"chain{world}.json")],
                    project, nproc=world, preload=(QWEN3_MOE_MODELING,), env={"PYTHONPATH": str(REPO)})
    assert_ran(proc)
    return {run["name"]: (read_metrics(run["metrics"]), json.loads((tmp_path / f"{run['name']}.dtypes.json").read_text()))
            for run in runs}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every layout trained (one launch per world size) and the single-process reference."""
    tmp_path = tmp_path_factory.mktemp("mixed_precision")
    project = make_project(tmp_path / "project")
    _save_weights((project / TINY_RECIPE).parent / "models" / "tiny-qwen3-moe")
    results = {}
    for world in sorted({world for world, _ in LAYOUTS.values()}):
        results.update(_chain(project, tmp_path, world, [name for name, (w, _) in LAYOUTS.items() if w == world]))
    reference_recipe = (project / TINY_RECIPE).with_name("mp_reference.yaml")
    reference_recipe.write_text(_recipe_text(project, "tp2"))
    float32_recipe = (project / TINY_RECIPE).with_name("mp_float32.yaml")
    float32_recipe.write_text(_recipe_text(project, "tp2").replace("torch_dtype: bfloat16", "torch_dtype: float32"))
    return results, reference_training(reference_recipe), reference_training(float32_recipe)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bf16_mixed_precision_trains_like_one_process(trained, layout):
    results, want, float32 = trained
    got, dtypes = results[layout]
    assert dtypes == {"parameters": ["torch.float32"], "optimizer_state": ["torch.float32"]}, dtypes
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert got[-1]["loss"] < got[0]["loss"] * 0.995  # it trains
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert math.isclose(a["loss"], b["loss"], rel_tol=LOSS_RTOL), (layout, step, a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=NORM_RTOL), (layout, step, a, b)
    # bf16 did compute: the float32 run's figures are not these
    assert max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(got, float32)) > 1e-4


@pytest.mark.parametrize("setting", ["default", "none"])
def test_an_update_below_bf16_resolution_moves_the_float32_master_weights(project, setting):
    """The RMSNorm weights start at 1.0, where bf16's values are 2^-7 apart: AdamW's
    steps of about lr = 1e-4 round away on bf16 weights, and add up on float32 masters.
    The model is built and stepped by the trainer's own pieces (parameter_dtype through
    build_hf_model, compute_context); ``mixed_precision: none`` shows the test can fail."""
    data = yaml.safe_load(_recipe_text(project, "tp2"))
    data["optimizer"]["lr"] = 1.0e-4
    if setting == "none":
        data["training"]["mixed_precision"] = "none"
    recipe = (project / TINY_RECIPE).with_name("mp_resolution.yaml")
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    config = load_training_config(recipe)
    torch.manual_seed(0)
    model = build_hf_model(Recipe.load(config).hf_config, config, with_weights=False)
    norms = {name: p for name, p in model.named_parameters() if name.endswith("norm.weight")}
    before = {name: p.detach().clone() for name, p in norms.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0e-4, foreach=False)
    for step in range(10):
        batch = global_batch(step, config.training, config.dataset, model.config.vocab_size)
        with compute_context(config, fsdp_casts=False):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    moved = {name: (p.detach() - before[name]).abs().max().item() for name, p in norms.items()}
    if setting == "none":  # pure bf16: every update lost
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert set(moved.values()) == {0.0}, moved
    else:
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert all(5e-4 < value < 2e-3 for value in moved.values()), moved  # about 10 steps x lr
