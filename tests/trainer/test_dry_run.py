"""``trainer dry-run`` (issue 52, item 4): every rank of the tiny recipe's world alone on this
machine on torch's fake process group, each in a process of its own."""

import json
import subprocess
import sys

import pytest

from tests.project_fixtures import REPO, TINY_RECIPE

QUICKSTART_RECIPE = REPO / "recipes/quickstart/quickstart.yaml"

pytestmark = [pytest.mark.slow]


def _dry_run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hyper_parallel.trainer", "dry-run", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_every_rank_of_the_tiny_recipe_runs_alone_and_reports(tmp_path):
    before = sorted(p.name for p in (REPO / "recipes/tiny_cpu").iterdir())
    proc = _dry_run("--config", TINY_RECIPE, "--rank", "all", "--steps", "2", "--json", str(tmp_path / "dry.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = json.loads((tmp_path / "dry.json").read_text())
    assert [report["rank"] for report in reports] == [0, 1] and {report["world"] for report in reports} == {2}
    for report in reports:
        assert report["steps"] == 2 and len(report["step_s"]) == 2 and report["device"] == "cpu", report
        assert report["steady_step_s"] > 0 and report["peak_memory_bytes"] > 2**20, report
        assert f"rank {report['rank']}/2 on cpu: 2 steps" in proc.stdout
    assert sorted(p.name for p in (REPO / "recipes/tiny_cpu").iterdir()) == before  # nothing saved beside it


def test_a_rank_outside_the_world_is_refused():
    proc = _dry_run("--config", TINY_RECIPE, "--rank", "2", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--rank: expected 0..1" in proc.stderr and "got '2'" in proc.stderr


def test_fake_tensors_run_every_rank_and_count_each_ranks_parameters_exactly(tmp_path):
    """--fake-tensors: shapes without storage, memory from torch's tracker. The parameter and
    gradient terms are the rank's own local shards, byte for byte (tp 2 halves each sharded
    tensor; what the plan replicates stays whole), and the optimizer states are counted."""
    proc = _dry_run("--config", TINY_RECIPE, "--rank", "all", "--fake-tensors", "--json", str(tmp_path / "dry.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = json.loads((tmp_path / "dry.json").read_text())
    expected = _local_parameter_bytes(REPO / TINY_RECIPE, tmp_path)
    for report, local_bytes in zip(reports, expected, strict=True):
        kinds = report["peak_by_kind_bytes"]
        assert report["device"] == "cpu (fake tensors)", report
        assert kinds["Parameter"] == local_bytes and kinds["Gradient"] == local_bytes, (report, expected)
        assert kinds["Optstate"] >= 2 * local_bytes, report  # AdamW's two moments, after step 1
        assert report["peak_memory_bytes"] == sum(kinds.values()), report
        assert "micro-batches per step run" in proc.stdout


def _local_parameter_bytes(recipe, tmp_path) -> list[int]:
    """Each rank's bytes of local parameter shards, from a real run of the bundle's plan
    (a torchrun world of the recipe's size on gloo, as training builds it)."""
    code = ("import torch.distributed as dist, os\n"
            "from torch.distributed.tensor import DTensor\n"
            "from hyper_parallel.config import load_training_config\n"
            "from hyper_parallel.trainer.base import BaseTrainer\n"
            f"config = load_training_config({str(recipe)!r}, [])\n"
            "config.model.init = 'random'\n"
            "trainer = BaseTrainer(config, resume=False)\n"
            "local = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in trainer.model.parameters())\n"
            "print(f'BYTES {dist.get_rank()} {local}', flush=True)\n")
    script = tmp_path / "local_bytes.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = dict(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("BYTES "))
    return [int(found[str(rank)]) for rank in range(2)]


def test_fake_tensors_need_what_real_tensors_need_on_a_dense_model():
    """The fake run's peak, by kind, equals the peak the same tracker measures over the same
    steps on real tensors (a dense model: no routing, whose fake load is a stand-in)."""
    figures = {}
    for kind in ("fake", "real"):
        proc = subprocess.run([sys.executable, "-m", "tests.trainer.tracked_rank", str(QUICKSTART_RECIPE), kind],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        figures[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["fake"] == figures["real"] and figures["fake"]["Activation"] > 0, figures
