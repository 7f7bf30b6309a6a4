"""A checkpoint saved at one layout resumes at another (``trainer/checkpoint_layout.py``)
and trains on exactly as one process does from the same state (fp32, CPU, gloo).

One chain, five trainings: tp2+cp2+ep2 at world 4 saves step 2 (its gate_up_proj is a
strided shard, saved as blocks); one process resumes it (blocks loaded whole), trains
steps 3 to 6 and saves steps 4 and 6 whole: its losses and gradient norms are the
reference. tp2 at world 2 resumes step 2 of the world-4 run and saves step 4 (blocks);
dp2 with FSDP2 (gate_up_proj unpacked, sharded over dp) resumes that; tp2 resumes the
one process's step 4 (whole, loaded into strided blocks). The world-4, one-process and
dp2 runs use the hf backend (planned at start), the tp2 runs the tiny recipe's own
generated bundle, so no launch regenerates a bundle. Last, two ranks export tp2's
checkpoint as an HF folder (``trainer export``).

The three world-2 trainings (tp2, dp2, tp2 again) run one after another in one launch
(tests/trainer/train_chain_worker.py: a new trainer per run, in the same ranks), so the
chain takes four launches, not six."""

import json
import math
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
import yaml

from hyper_parallel.config import load_training_config
from hyper_parallel.distributed.weight_map import saved_layout
from hyper_parallel.trainer.data import global_batch, micro_batches
from hyper_parallel.trainer.checkpoint_layout import adapt_view, saved_tensors
from hyper_parallel.trainer.metrics import read_metrics
from tests.launch import assert_ran, torchrun
from tests.pipeline.pipeline_helpers import copy_project, generated_tiny_project
from tests.project_fixtures import REPO, TINY_RECIPE
from tests.trainer.test_export import exported_keys

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

QWEN3_MOE_MODELING = "transformers.models.qwen3_moe.modeling_qwen3_moe"  # imported once, before the ranks fork
CHAIN_MARKER = "train_chain_worker: run "  # the line rank 0 prints before each run of a chain

LAYOUTS = {
    "tp2_cp2_ep2": {"nproc_per_node": 4, "dp_size": 1, "tp_size": 2, "cp_size": 2, "ep_size": 2},
    "tp2": {"nproc_per_node": 2, "dp_size": 1, "tp_size": 2},
    "dp2_fsdp2": {"nproc_per_node": 2, "dp_size": 2, "tp_size": 1},
    "one": {"nproc_per_node": 1, "dp_size": 1, "tp_size": 1},
}


def _recipe(project, name: str, layout: str, steps: int, checkpoints: str, *, gen: bool, write: bool = True):
    """The tiny recipe at ``layout``: a copy beside it for the hf backend; for the gen
    backend the recipe itself (the tp2 bundle is generated for it). Its path, and with
    ``write=False`` its text, unwritten (the chain worker writes it before its run)."""
    data = yaml.safe_load((REPO / TINY_RECIPE).read_text())
    data["accelerator"].update(LAYOUTS[layout])
    if not gen:
        data.pop("codegen", None)
        data["modeling_backend"] = "hf"
    data["training"].update(steps=steps, global_batch_size=4, micro_batch_size=2, seq_len=12, checkpoint={
        "dir": checkpoints, "every_steps": 2, "keep_last": 0, "async": False})
    # the gen runs keep the recipe's own name: its bundle is current (checkpoints are no codegen input)
    path = project / TINY_RECIPE if gen else (project / TINY_RECIPE).with_name(f"{name}.yaml")
    if not write:
        return path, yaml.safe_dump(data, sort_keys=False)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _train(project, recipe, metrics, nproc: int):
    proc = torchrun(["-m", "hyper_parallel.trainer", "--config", str(recipe), "--metrics", str(metrics)],
                    project, nproc=nproc, preload=(QWEN3_MOE_MODELING,))
    assert_ran(proc)
    return proc, read_metrics(metrics)


def _train_chain(project, tmp_path, runs):
    """``runs`` (name, (recipe, text), [(source, destination) checkpoint copies]) trained in
    turn by two ranks of one launch (tests/trainer/train_chain_worker.py); each run's
    stdout and rank 0's metrics, in order."""
    chain = [{"name": name, "recipe": str(recipe), "text": text, "metrics": str(tmp_path / f"{name}.json"),
              "copies": [[str(a), str(b)] for a, b in copies]} for name, (recipe, text), copies in runs]
    (tmp_path / "chain.json").write_text(json.dumps(chain))
    # run in the project (its relative paths), the worker imported from this checkout
    proc = torchrun(["-m", "tests.trainer.train_chain_worker", "--chain", str(tmp_path / "chain.json")],
                    project, nproc=2, preload=(QWEN3_MOE_MODELING,), env={"PYTHONPATH": str(REPO)})
    assert_ran(proc)
    outputs, current = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith(CHAIN_MARKER):
            current = line[len(CHAIN_MARKER):]
            outputs[current] = ""
        elif current is not None:
            outputs[current] += line + "\n"
    assert list(outputs) == [name for name, _, _ in runs], proc.stdout
    return outputs, [read_metrics(tmp_path / f"{name}.json") for name, _, _ in runs]


def _assert_same_steps(got, want, where: str):
    assert [r["step"] for r in got] == [r["step"] for r in want], where
    for a, b in zip(got, want):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (where, got, want)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (where, got, want)


def test_resume_at_another_layout_trains_like_one_process(tmp_path_factory, tmp_path):
    project = copy_project(generated_tiny_project(tmp_path_factory), tmp_path / "project")
    folder = (project / TINY_RECIPE).parent

    _train(project, _recipe(project, "save_w4", "tp2_cp2_ep2", 2, "ck_w4", gen=False), tmp_path / "w4.json", 4)
    assert any("gate_up_proj@part0of2" in key for key in saved_tensors(folder / "ck_w4" / "step_2"))
    for copy in ("ck_tp2", "ck_one"):
        shutil.copytree(folder / "ck_w4" / "step_2", folder / copy / "step_2")

    # the reference: one process from step 2 (packed experts saved as blocks, loaded whole)
    _, reference = _train(project, _recipe(project, "one", "one", 6, "ck_one", gen=False), tmp_path / "one.json", 1)
    assert [r["step"] for r in reference] == [3, 4, 5, 6]
    assert "model.model.layers.0.mlp.experts.gate_up_proj" in saved_tensors(folder / "ck_one" / "step_4")

    # the world-2 legs, in one launch: tp2 resumes the world-4 step 2 and saves step 4;
    # dp2 with FSDP2 resumes that; and back: saved whole by one process, resumed with
    # tp2's strided gate_up_proj
    outputs, (tp2, dp2, back) = _train_chain(project, tmp_path, [
        ("tp2", _recipe(project, "tp2", "tp2", 4, "ck_tp2", gen=True, write=False), []),
        ("dp2", _recipe(project, "dp2", "dp2_fsdp2", 6, "ck_dp2", gen=False, write=False),
         [(folder / "ck_tp2" / "step_4", folder / "ck_dp2" / "step_4")]),
        ("back", _recipe(project, "back", "tp2", 6, "ck_back", gen=True, write=False),
         [(folder / "ck_one" / "step_4", folder / "ck_back" / "step_4")]),
    ])
    assert "resumed from checkpoint" in outputs["tp2"], outputs["tp2"]
    _assert_same_steps(tp2, reference[:2], "tp2+cp2+ep2 at world 4 -> tp2")
    _assert_same_steps(dp2, reference[2:], "tp2 -> dp2 with FSDP2")
    _assert_same_steps(back, reference[2:], "one process -> tp2")

    _check_export(project, folder / "ck_tp2" / "step_4", tmp_path / "hf", folder / "dp2.yaml", dp2[0]["loss"])


def _check_export(project, step, out, recipe, step_5_loss: float):
    """tp2's checkpoint (packed blocks) exported by two ranks: HF's names, each rank's own
    files, the logits of the trained state loaded into transformers' class, and on step
    5's batch the loss the parallel (dp2) run computed from that state."""
    proc = torchrun(["-m", "hyper_parallel.trainer", "export", "--checkpoint", str(step), "--out", str(out)],
                    project, nproc=2)
    assert_ran(proc)
    assert sorted({f.name.split("-")[1] for f in out.glob("*.safetensors")}) == ["rank000", "rank001"]
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                                 dtype=torch.float32)
    assert exported_keys(out) == set(saved_layout(exported))
    trained = transformers.AutoModelForCausalLM.from_config(exported.config, attn_implementation="eager",
                                                            dtype=torch.float32)
    view, restores = adapt_view({"model": trained.state_dict()}, [], saved_tensors(step))
    dcp.load(view, checkpoint_id=str(step), no_dist=True)
    for restore in restores:
        restore.run()
    ids = torch.randint(0, exported.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, trained(input_ids=ids).logits)
        config = load_training_config(recipe)
        batch = global_batch(4, config.training, config.dataset, exported.config.vocab_size)  # step 5's
        parts = list(micro_batches(batch, 0, 1, config.training.micro_batch_size, "export"))
        loss = sum(exported(input_ids=micro, labels=micro).loss.item() / len(parts) for micro in parts)
    assert math.isclose(loss, step_5_loss, rel_tol=1e-5), (loss, step_5_loss)
