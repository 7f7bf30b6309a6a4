"""Pipeline parallel trains exactly like one process: the tiny Qwen3-MoE recipe (gen
backend, 2 decoder layers: one per stage) under torchrun, each step's loss and every
parameter's gradient of 3 AdamW steps equal to single-process HF training on the same
weights and micro-batches (fp32; loss rtol 1e-5, gradients rtol 1e-4). Composed with tp,
FSDP2 over dp, and ep over the dp ranks of each stage."""

import math
import shutil
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from hyper_parallel.codegen.check.verify_mode import MAX_PROCS_ENV
from hyper_parallel.trainer.export import export_checkpoint
from hyper_parallel.trainer.metrics import read_metrics
from hyper_parallel.trainer.reference import reference_training
from tests.batch_launch import Batches
from tests.launch import assert_ran, torchrun
from tests.project_fixtures import REPO, TINY_RECIPE, make_project

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 3
QWEN3_MOE_MODELING = "transformers.models.qwen3_moe.modeling_qwen3_moe"

LAYOUTS = {
    "pp2_1f1b": {"nproc_per_node": 2, "pp_size": 2, "tp_size": 1},
    "pp2_tp2_gpipe": {"nproc_per_node": 4, "pp_size": 2, "tp_size": 2, "pipeline": {"schedule": "gpipe"}},
    "pp2_dp2_fsdp2": {"nproc_per_node": 4, "pp_size": 2, "dp_size": 2, "tp_size": 1},
    "pp2_dp2_ep2": {"nproc_per_node": 4, "pp_size": 2, "dp_size": 2, "tp_size": 1, "ep_size": 2},
    "pp2_tp2_lp": {"nproc_per_node": 4, "pp_size": 2, "tp_size": 2, "loss_parallel": True},
    # the residual stream split over the sequence: the stages hand on the whole sequence
    "pp2_tp2_sp_lp": {"nproc_per_node": 4, "pp_size": 2, "tp_size": 2, "sequence_parallel": True,
                      "loss_parallel": True},
    "pp2_cp2": {"nproc_per_node": 4, "pp_size": 2, "tp_size": 1, "cp_size": 2,
                "context_parallel": {"algorithm": "gather_sequence"}},
    "pp2_cp2_allgather_kv": {"nproc_per_node": 4, "pp_size": 2, "tp_size": 1, "cp_size": 2,
                             "context_parallel": {"algorithm": "allgather_kv"}},
    # one embedding matrix for input and head: a copy on each end stage, gradients summed
    "pp2_tp2_tied": {"nproc_per_node": 4, "pp_size": 2, "tp_size": 2, "tied": True},
    # two virtual stages per rank (4 layers: rank 0 runs stages 0 and 2, rank 1 stages 1 and 3)
    "pp2_dp2_interleaved": {"nproc_per_node": 4, "pp_size": 2, "dp_size": 2, "tp_size": 1, "layers": 4,
                            "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2},
                            "stages": [((0, 2), (0, 2)), ((1, 3), (1, 3))]},
    # zero-bubble schedules: each backward split into the input's and the weights' gradients
    "pp2_izb": {"nproc_per_node": 2, "pp_size": 2, "tp_size": 1, "layers": 4,
                "pipeline": {"schedule": "interleaved_zero_bubble", "virtual_stages": 2},
                "stages": [((0, 2), (0, 2)), ((1, 3), (1, 3))]},
    "pp2_zbv": {"nproc_per_node": 2, "pp_size": 2, "tp_size": 1, "layers": 4,
                "pipeline": {"schedule": "zbv", "virtual_stages": 2},
                "stages": [((0, 3), (0, 3)), ((1, 2), (1, 2))]},
    # a V: the first and the last stage on rank 0, so a tied matrix is one parameter there
    "pp2_tp2_zbv_tied": {"nproc_per_node": 4, "pp_size": 2, "tp_size": 2, "layers": 4, "tied": True,
                         "pipeline": {"schedule": "zbv", "virtual_stages": 2},
                         "stages": [((0, 3), (0, 3)), ((1, 2), (1, 2))]},
    # a rank's other stage's modules are swapped out while one stage runs (their hooks, which split
    # and gather the sequence, do not run)
    "pp2_cp2_i1f1b": {"nproc_per_node": 4, "pp_size": 2, "tp_size": 1, "cp_size": 2, "layers": 4,
                      "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2},
                      "stages": [((0, 2), (0, 2)), ((1, 3), (1, 3))]},
    "pp2_dualpipev": {"nproc_per_node": 2, "pp_size": 2, "tp_size": 1, "layers": 4,
                      "pipeline": {"schedule": "dualpipev", "virtual_stages": 2},
                      "stages": [((0, 3), (0, 3)), ((1, 2), (1, 2))]},
    "pp2_interleaved": {"nproc_per_node": 2, "pp_size": 2, "tp_size": 1, "layers": 4,
                        "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2},
                        "stages": [((0, 2), (0, 2)), ((1, 3), (1, 3))]},
}


def _recipe(project, layout: str):
    recipe = project / TINY_RECIPE
    data = yaml.safe_load(recipe.read_text())
    accelerator = dict(LAYOUTS[layout])
    tied, layers = accelerator.pop("tied", False), accelerator.pop("layers", None)
    accelerator.pop("stages", None)
    data["accelerator"].update(accelerator)
    data["model"]["init"] = "pretrained"
    data["training"].update(steps=STEPS, global_batch_size=4, micro_batch_size=1, seq_len=12)
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    model_dir = recipe.parent / data["model"]["pretrained_model_name_or_path"]
    config = transformers.AutoConfig.from_pretrained(model_dir)
    config.tie_word_embeddings = tied
    config.num_hidden_layers = layers or config.num_hidden_layers
    torch.manual_seed(2024)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.save_pretrained(model_dir)  # config.json too; a tied head is stored once, as transformers does
    return recipe


def _launch(world: int, out, cases):
    return torchrun(["-m", "tests.trainer.pipeline_worker", "--out", str(out), "--cases", str(cases)], REPO,
                    nproc=world, preload=(QWEN3_MOE_MODELING,), env={MAX_PROCS_ENV: "1"}, timeout=900)


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """Every layout's own project (its recipe, weights and bundle), trained by one torchrun
    launch per world size, each layout in turn in the same ranks with a new trainer
    (tests/batch_launch.py): rank start-up (python, torch, transformers) once per launch,
    not once per layout. Each test reads its own layout's per-rank results, so a failure
    names the layout. Returns the batches and each layout's recipe and results folder."""
    root = tmp_path_factory.mktemp("pipeline_training")
    cases, recipes = {}, {}
    for layout in sorted(LAYOUTS):
        project = make_project(root / layout / "project")
        recipe, ranks = _recipe(project, layout), root / layout / "ranks"
        recipes[layout] = recipe, ranks
        cases[layout] = (LAYOUTS[layout]["nproc_per_node"], [
            "--recipe", str(recipe), "--steps", str(STEPS), "--out", str(ranks),
            "--workspace", str(project / "generated")])
    return Batches(root / "out", cases, _launch), recipes


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pipeline_training_matches_one_process_in_loss_and_every_gradient(batches, layout):
    batched, recipes = batches
    recipe, out = recipes[layout]
    world = LAYOUTS[layout]["nproc_per_node"]
    assert [Path(r["saved"]) for r in batched.results(layout)] == [out / f"rank{rank}.pt" for rank in range(world)]
    # the bundle's plan records the split the stages ran (and the review diff shows it)
    modeling = "".join(path.read_text() for path in (recipe.parent / "generated").glob("modeling_*.py"))
    one_layer_stages = ", ".join(f"[{i}, {i + 1}]" for i in range(LAYOUTS[layout].get("layers", 2)))
    assert f'"pipeline": {{"stages": [{one_layer_stages}]}},' in modeling
    ranks = [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)]
    reference = reference_training(recipe, gradients=True)  # one process, the whole HF model
    want_losses, want_grads = [r["loss"] for r in reference], [r["grads"] for r in reference]
    # the stages split the layers and hold each parameter once between them
    stages = sorted({(tuple(rank["stage"][0]), tuple(rank["stage"][1])) for rank in ranks})
    assert stages == LAYOUTS[layout].get("stages", [((0,), (0,)), ((1,), (1,))]), stages
    # a tied head is the embedding matrix: the last stage's copy must match its gradient
    alias = {"lm_head.weight": "model.embed_tokens.weight"} if LAYOUTS[layout].get("tied") else {}
    held = {}
    for rank in ranks:
        for name in rank["grads"][0]:
            held.setdefault(alias.get(name, name), set()).add(tuple(rank["stage"][0]))
    assert set(held) == set(want_grads[0]), set(want_grads[0]) ^ set(held)
    assert all(len(on) == 1 or name in alias.values() for name, on in held.items()), held
    for rank in ranks:
        for step in range(STEPS):
            assert abs(rank["losses"][step] - want_losses[step]) <= 1e-5 * abs(want_losses[step]), (
                step, rank["losses"], want_losses)
            for name, got in rank["grads"][step].items():
                want = want_grads[step][alias.get(name, name)]
                assert _grads_agree(got, want, step), (layout, step, name, (got - want).abs().max().item(),
                                                       want.abs().max().item())


def _grads_agree(got: torch.Tensor, want: torch.Tensor, step: int) -> bool:
    """Element by element at the first step (rtol 1e-4, atol 1e-6); after it at each
    tensor's scale (largest difference within 1e-6 + 1e-4 x its largest element), as verify
    compares: AdamW moves every weight by about lr * sign(g), so float noise in a gradient
    element near zero at step 1 (another reduction order) becomes a weight difference of
    order lr there, and an element-wise check later would call it an error. A wrong
    reduction is off by the gradient's own size at every step."""
    if step == 0:
        return torch.allclose(got, want, rtol=1e-4, atol=1e-6)
    return (got - want).abs().max().item() <= 1e-6 + 1e-4 * want.abs().max().item()


def _hf_recipe(project, name: str, accelerator: dict, steps: int, checkpoints: str):
    """A copy of the tiny recipe beside it, on the hf backend (planned at start: no bundle
    is generated per layout), checkpointing every 2 steps into ``checkpoints``."""
    data = yaml.safe_load((project / TINY_RECIPE).read_text())
    data.pop("codegen", None)
    data["modeling_backend"] = "hf"
    data["accelerator"].update({"dp_size": 1, "tp_size": 1, "pp_size": 1, **accelerator})
    data["model"]["init"] = "pretrained"
    data["training"].update(steps=steps, global_batch_size=4, micro_batch_size=1, seq_len=12, checkpoint={
        "dir": checkpoints, "every_steps": 2, "keep_last": 0, "async": False}, eval={"every_steps": 2, "batches": 2})
    path = (project / TINY_RECIPE).with_name(f"{name}.yaml")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _train(project, recipe, metrics, nproc: int):
    proc = torchrun(["-m", "hyper_parallel.trainer", "--config", str(recipe), "--metrics", str(metrics)], project,
                    nproc=nproc, preload=(QWEN3_MOE_MODELING,))
    assert_ran(proc)
    return proc, read_metrics(metrics)


def test_a_checkpoint_resumes_across_a_pp_change_and_exports(project, tmp_path):
    """pp2 saves, one process resumes it; one process saves, pp2 resumes it: each resumed
    run's steps equal the uninterrupted run's; pp2 and one process evaluate alike. A pp2 checkpoint exports to an HF folder
    whose logits are those of the one-process run's export of the same step."""
    _recipe(project, "pp2_1f1b")  # the saved weights (the recipe itself is not used below)
    pp2 = _hf_recipe(project, "pp2", {"nproc_per_node": 2, "pp_size": 2}, 4, "pp2_checkpoints")
    one = _hf_recipe(project, "one", {"nproc_per_node": 1}, 4, "one_checkpoints")
    _, whole_pp2 = _train(project, pp2, tmp_path / "pp2.json", 2)
    _, whole_one = _train(project, one, tmp_path / "one.json", 1)
    for a, b in zip(whole_pp2, whole_one):  # the two layouts train alike, and evaluate alike (pp: the schedule's eval)
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (whole_pp2, whole_one)
        assert (a["eval_loss"] is None) == (b["eval_loss"] is None) == (a["step"] % 2 == 1), (whole_pp2, whole_one)
        assert a["eval_loss"] is None or math.isclose(a["eval_loss"], b["eval_loss"], rel_tol=1e-5), (a, b)
    folder = pp2.parent
    for source, resumer, nproc in (("pp2_checkpoints", one, 1), ("one_checkpoints", pp2, 2)):
        target = folder / f"from_{source}"
        target.mkdir()
        shutil.copytree(folder / source / "step_2", target / "step_2")
        data = yaml.safe_load(resumer.read_text())
        data["training"]["checkpoint"]["dir"] = target.name
        resumer.write_text(yaml.safe_dump(data, sort_keys=False))
        proc, resumed = _train(project, resumer, tmp_path / f"resumed_{source}.json", nproc)
        assert f"resumed from checkpoint {target / 'step_2'} (step 2)" in proc.stdout
        want = whole_one if resumer == one else whole_pp2
        assert [r["step"] for r in resumed] == [3, 4]
        for got, expected in zip(resumed, want[2:]):
            assert math.isclose(got["loss"], expected["loss"], rel_tol=1e-5), (source, resumed, want)
            assert math.isclose(got["grad_norm"], expected["grad_norm"], rel_tol=1e-4), (source, resumed, want)
    logits = {}
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(3))
    for source in ("pp2_checkpoints", "one_checkpoints"):
        out = tmp_path / f"hf_{source}"
        export_checkpoint(folder / source / "step_4", out)
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            logits[source] = model(input_ids=ids).logits
    torch.testing.assert_close(logits["pp2_checkpoints"], logits["one_checkpoints"], rtol=1e-4, atol=1e-5)
