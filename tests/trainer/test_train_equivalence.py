"""The tiny recipe trains under torchrun with the gen backend, and its per-step losses
and gradient norms equal single-process HF training on the same data and weights.

Rank 0 generates the bundle at start; its verify stage runs the ranks as threads of one
process (verify's own mode above its process cap, ``$HYPER_PARALLEL_VERIFY_MAX_PROCS``;
tests/verify/test_verify_modes.py shows both modes give the same verdict and figures).
Training is what is under test here, and at world 4 a torchrun verify starts five more
torch processes on a 2-core machine for each layout.

The eager layouts of a world size train one after another in one launch, a new trainer
each (tests/trainer/train_cases_worker.py), each in its own project and bundle: rank
start-up once per world size. The compiled ones start the trainer CLI as a user does."""

import math

import pytest
import torch
import transformers
import yaml
from safetensors.torch import save_file

from hyper_parallel.config import load_training_config
from hyper_parallel.trainer.data import global_batch, micro_batches
from hyper_parallel.codegen.check.verify_mode import MAX_PROCS_ENV
from hyper_parallel.trainer.metrics import read_metrics
from tests.batch_launch import Batches
from tests.launch import assert_ran, torchrun
from tests.project_fixtures import REPO, TINY_RECIPE, make_project

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 4


def _save_weights(model_dir) -> None:
    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(2024)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(model_dir / "model.safetensors"))


def _reference_run(recipe_path) -> tuple[list[float], list[float]]:
    """Per-step losses and gradient norms of single-process HF training."""
    config = load_training_config(recipe_path)
    model_dir = recipe_path.parent / config.model.pretrained_model_name_or_path
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                                              dtype=torch.float32)
    opt = config.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=tuple(opt.betas),
                                  weight_decay=opt.weight_decay, foreach=False)
    losses, grad_norms = [], []
    for step in range(STEPS):
        batch = global_batch(step, config.training, config.dataset, model.config.vocab_size)
        parts = list(micro_batches(batch, 0, 1, config.training.micro_batch_size, "ref"))
        total = 0.0
        for micro in parts:
            loss = model(input_ids=micro, labels=micro).loss / len(parts)
            loss.backward()
            total += loss.item()
        grad_norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        if config.training.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.training.max_grad_norm, foreach=False)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, grad_norms


QWEN3_MOE_MODELING = "transformers.models.qwen3_moe.modeling_qwen3_moe"  # imported once, before the ranks fork
# Both Qwen3-MoE replacements, lowered into the generated model.
REPLACEMENTS = [
    {"match": "*.self_attn", "replace_module": {
        "_target_": "hyper_parallel.models.qwen3_moe.adapter.replacements.replace_qwen3_moe_flash_attention"}},
    {"match": "*.mlp.experts", "replace_module": {
        "_target_": "hyper_parallel.models.qwen3_moe.adapter.replacements.replace_qwen3_moe_grouped_experts"}},
]

LAYOUTS = {
    # Gradient norms are about 2.5 here: max_grad_norm 1.0 clips every step.
    "tp2_clipped": {"nproc_per_node": 2, "tp_size": 2, "max_grad_norm": 1.0},
    "dp2_fsdp2": {"nproc_per_node": 2, "dp_size": 2, "tp_size": 1},
    "tp2_cp2_ep2_sp_lp": {"nproc_per_node": 4, "tp_size": 2, "cp_size": 2, "ep_size": 2,
                          "sequence_parallel": True, "loss_parallel": True},
    # ep over the dp ranks themselves (experts sharded by FSDP2 over edp = 1) ...
    "dp2_ep2_fsdp2_clipped": {"nproc_per_node": 2, "dp_size": 2, "tp_size": 1, "ep_size": 2, "max_grad_norm": 1.0},
    # ... and over the cp ranks, with each expert held by the 2 dp ranks (edp = 2).
    # FSDP2 over dp on top of tp (2D), with both replacements.
    "dp2_tp2_fsdp2_replaced": {"nproc_per_node": 4, "dp_size": 2, "tp_size": 2, "replacements": True},
    # the sequence gathered before attention (the algorithm that splits no attention)
    "dp2_cp2_ep2_fsdp2": {"nproc_per_node": 4, "dp_size": 2, "cp_size": 2, "tp_size": 1, "ep_size": 2,
                          "context_parallel": {"algorithm": "gather_sequence"}},
    # context parallel left to its default, allgather_kv load-balanced (K/V all-gathered over
    # cp), with the fused attention replacement, sequence parallel and the vocab-sharded loss
    "tp2_cp2_ep2_sp_lp_replaced": {"nproc_per_node": 4, "tp_size": 2, "cp_size": 2, "ep_size": 2,
                                   "sequence_parallel": True, "loss_parallel": True, "replacements": True},
    # pipeline parallel through the whole trainer loop (the loss from the last stage, the
    # gradient norm summed over the stages); tests/trainer/test_pipeline_training.py
    # compares every gradient of the pipeline layouts
    "pp2": {"nproc_per_node": 2, "pp_size": 2, "tp_size": 1},
    # training.compile: each decoder layer compiled (inductor) with the DTensor plan, and
    # under FSDP2; equal to one eager process as every other layout
    "tp2_compiled": {"nproc_per_node": 2, "tp_size": 2, "compile": True},
    "dp2_fsdp2_compiled": {"nproc_per_node": 2, "dp_size": 2, "tp_size": 1, "compile": True},
}


# The compiled layouts train in a launch of their own (the trainer CLI); the others, by world
# size, in one launch each (tests/trainer/train_cases_worker.py: a new trainer per layout).
COMPILED = sorted(layout for layout in LAYOUTS if LAYOUTS[layout].get("compile"))
BATCHED = sorted(layout for layout in LAYOUTS if layout not in COMPILED)


def _prepare(project, layout: str):
    """The tiny recipe at ``layout`` trained ``STEPS`` steps from weights saved beside it:
    the recipe's path, its content and its accelerator keys."""
    recipe = project / TINY_RECIPE
    data = yaml.safe_load(recipe.read_text())
    accelerator = dict(LAYOUTS[layout])
    if accelerator.pop("replacements", False):
        data["plan_overrides"] = REPLACEMENTS
    max_grad_norm = accelerator.pop("max_grad_norm", None)
    data["training"]["compile"] = accelerator.pop("compile", False)
    data["accelerator"].update(accelerator)
    data["model"]["init"] = "pretrained"  # the weights saved below
    data["training"].update(steps=STEPS, global_batch_size=4, micro_batch_size=2, seq_len=12,
                            max_grad_norm=max_grad_norm)
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    _save_weights(recipe.parent / data["model"]["pretrained_model_name_or_path"])
    return recipe, data, accelerator


def _launch(world: int, out, cases):
    return torchrun(["-m", "tests.trainer.train_cases_worker", "--out", str(out), "--cases", str(cases)], out,
                    nproc=world, env={MAX_PROCS_ENV: "1", "PYTHONPATH": str(REPO)}, preload=(QWEN3_MOE_MODELING,),
                    timeout=900)


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """Every batched layout's own project (recipe, weights, bundle), trained by one launch
    per world size (tests/batch_launch.py: a failure names its layout); per layout its
    recipe, content, accelerator keys, metrics file and log prefix."""
    root = tmp_path_factory.mktemp("train_equivalence")
    cases, runs = {}, {}
    for layout in BATCHED:
        project = make_project(root / layout / "project")
        recipe, data, accelerator = _prepare(project, layout)
        metrics, log = root / layout / "metrics.json", root / layout / "trainer.log"
        runs[layout] = recipe, data, accelerator, metrics, log
        cases[layout] = (accelerator["nproc_per_node"], ["--recipe", str(recipe), "--metrics", str(metrics),
                                                        "--log", str(log), "--workspace", str(project / "generated")])
    return Batches(root / "out", cases, _launch), runs


@pytest.mark.parametrize("layout", BATCHED)
def test_gen_backend_training_matches_single_process_hf(batches, layout):
    batched, runs = batches
    recipe, data, accelerator, metrics, log = runs[layout]
    batched.results(layout)
    world = accelerator["nproc_per_node"]
    out = "".join(log.with_name(f"{log.name}.rank{rank}").read_text() for rank in range(world))
    _assert_matches(recipe, data, accelerator, out, metrics)


@pytest.mark.parametrize("layout", COMPILED)
def test_compiled_gen_backend_training_matches_single_process_hf(project, tmp_path, layout):
    recipe, data, accelerator = _prepare(project, layout)
    metrics = tmp_path / "metrics.json"
    proc = torchrun(["-m", "hyper_parallel.trainer", "--config", str(recipe), "--metrics", str(metrics)], project,
                    nproc=accelerator["nproc_per_node"], env={MAX_PROCS_ENV: "1"}, preload=(QWEN3_MOE_MODELING,))
    assert_ran(proc)
    _assert_matches(recipe, data, accelerator, proc.stdout, metrics)


def _assert_matches(recipe, data, accelerator, out: str, metrics) -> None:
    """The run's output (the trainer's log lines) and metrics: every step's loss and
    gradient norm equal to one HF process's."""
    assert f"step {STEPS}/{STEPS}" in out
    if data["training"]["compile"]:  # the layers ran compiled: inductor's code, not eager
        assert "training.compile: 2 module(s) compiled" in out, out[-2000:]
    if accelerator.get("pp_size", 1) > 1:  # the split the stages run, said at start
        assert ("pipeline: 2 stages over pp 2 (1f1b, 2 micro-batches per step); decoder layers by stage: [0, 1) [1, 2)"
                in out), out[-2000:]
    if "plan_overrides" in data:  # the generated model applies the replacements
        modeling = "".join(path.read_text() for path in (recipe.parent / "generated").glob("modeling_*.py"))
        assert "replace_qwen3_moe_grouped_experts" in modeling and "replace_qwen3_moe_flash_attention" in modeling
    if accelerator.get("cp_size", 1) > 1:  # the bundle splits attention as the recipe says, or by default
        modeling = "".join(path.read_text() for path in (recipe.parent / "generated").glob("modeling_*.py"))
        algorithm = accelerator.get("context_parallel", {}).get("algorithm", "allgather_kv")
        # the plan records the algorithm, but the one that splits no attention (its format's default)
        assert (f'"cp_algorithm": "{algorithm}"' in modeling) == (algorithm != "gather_sequence")
        # the attention entries' line starts with the role
        assert ('"kv_gathered_attention | ' in modeling) == (algorithm == "allgather_kv")
    records = read_metrics(metrics)
    got, got_norms = [r["loss"] for r in records], [r["grad_norm"] for r in records]
    want, want_norms = _reference_run(recipe)
    assert len(got) == STEPS
    assert got[-1] < got[0]  # it trains
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert math.isclose(a, b, rel_tol=1e-4), (step, got, want)
    # AdamW hardly sees a gradient's scale; the norm does.
    for step, (a, b) in enumerate(zip(got_norms, want_norms), start=1):
        assert math.isclose(a, b, rel_tol=1e-4), (step, got_norms, want_norms)
