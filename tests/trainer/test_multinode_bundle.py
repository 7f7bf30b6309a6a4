"""Two nodes without a shared filesystem: ``torchrun --nnodes=2 --nproc_per_node=2`` on one
machine, each node started in its own copy of the project (its own disk: recipes, model
folder, bundle folder, workspace, token cache: each node's local rank 0 tokenizes the
corpus into its own, and the nodes' rows agree). Rank 0 builds the bundle on node 0 and sends its bytes;
node 1's local rank 0 installs them where node 1's copy is missing or stale, so training
starts and both nodes hold byte-identical bundles. A node-1 copy with the current
signature but edited bytes is not repaired: the start is refused on every rank, naming
node 1's ranks. A recipe rank 0 cannot generate fails every rank with rank 0's message."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import yaml

from hyper_parallel.codegen.check.verify_mode import MAX_PROCS_ENV
from hyper_parallel.launch.ranks import kill_tree
from hyper_parallel.runtime.meta import META_FILE
from tests.project_fixtures import TINY_RECIPE, bundle_bytes, make_project
from tests.trainer.corpus_fixtures import save_tokenizer, write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

BUNDLE = "recipes/tiny_cpu/generated"
LAUNCH_TIMEOUT_S = 300
PRELOAD = ["transformers", "hyper_parallel.trainer.__main__", "transformers.models.qwen3_moe.modeling_qwen3_moe"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_node_recipe(project):
    """The tiny recipe on 2 nodes x 2 ranks, training on a JSON-lines corpus (the model
    folder gets the corpus' tokenizer): each node tokenizes it into its own token cache."""
    recipe = project / TINY_RECIPE
    data = yaml.safe_load(recipe.read_text())
    data["accelerator"].update(nproc_per_node=2, nnodes=2, tp_size=2, dp_size=2)
    data["training"].update(steps=1, global_batch_size=2, micro_batch_size=1, seq_len=8)
    data["dataset"] = {"kind": "jsonl", "path": "corpus.jsonl"}
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    save_tokenizer(recipe.parent / data["model"]["pretrained_model_name_or_path"])
    write_jsonl(recipe.parent / "corpus.jsonl")


def _set_checkpoint_dir(project, folder):
    """``training.checkpoint.dir`` in the node's recipe (None: no checkpoints)."""
    recipe = project / TINY_RECIPE
    data = yaml.safe_load(recipe.read_text())
    data["training"]["checkpoint"] = {"dir": folder} if folder else {}
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))


def _run_two_nodes(nodes) -> list[subprocess.CompletedProcess]:
    """Both nodes' torchrun at once (static rendezvous on this machine), each in its own
    project copy; their finished processes, output captured."""
    port = _free_port()
    env_extra = {MAX_PROCS_ENV: "1", "OMP_NUM_THREADS": "1"}  # verify's ranks as threads inside the job
    procs = []
    for node, project in enumerate(nodes):
        # torchrun's own agent and rendezvous, its ranks forked from a launcher that imported
        # transformers and the trainer once per node (hyper_parallel.launch.forked_torchrun)
        command = [sys.executable, "-m", "hyper_parallel.launch.forked_torchrun", "--preload", ",".join(PRELOAD), "--",
                   "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                   f"--master_port={port}", "-m", "hyper_parallel.trainer", "--config", TINY_RECIPE]
        procs.append(subprocess.Popen(command, cwd=project, env={**os.environ, **env_extra}, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:  # a hung launch ends with the test, its ranks too
            if proc.poll() is None:
                kill_tree(proc)
    return done


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_nodes")
    node0 = make_project(root / "node0")
    _two_node_recipe(node0)
    node1 = root / "node1"
    shutil.copytree(node0, node1)  # the same checkout on another disk: no bundle on either
    return node0, node1


def _output(runs) -> str:
    return "\n".join(run.stdout[-3000:] + run.stderr[-6000:] for run in runs)


def test_node1_without_a_bundle_gets_rank0s_bytes_and_trains(nodes):
    node0, node1 = nodes
    assert not (node1 / BUNDLE).exists()
    runs = _run_two_nodes(nodes)
    assert all(run.returncode == 0 for run in runs), _output(runs)
    assert bundle_bytes(node0 / BUNDLE) == bundle_bytes(node1 / BUNDLE)
    # node 1 generated nothing (no recipe workspace there) but tokenized the corpus on its own disk
    assert sorted(p.name for p in (node1 / "generated").iterdir()) == ["tokens"]
    caches = [sorted((node / "generated" / "tokens").glob("*/rows.bin")) for node in nodes]
    assert len(caches[0]) == len(caches[1]) == 1 and caches[0][0].read_bytes() == caches[1][0].read_bytes()
    assert "node 1: installed rank 0's bundle" in _output(runs) and "copy was missing" in _output(runs)


def test_nodes_sharing_one_folder_install_it_once(tmp_path):
    """Both nodes started in one project folder (a shared filesystem): rank 0 installs the
    bundle, node 1 finds it current and writes nothing."""
    project = make_project(tmp_path / "shared")
    _two_node_recipe(project)
    _set_checkpoint_dir(project, "checkpoints")  # one folder for both nodes: saved whole
    runs = _run_two_nodes([project, project])
    assert all(run.returncode == 0 for run in runs), _output(runs)
    assert (project / BUNDLE / META_FILE).is_file()
    assert "installed rank 0's bundle" not in _output(runs)
    saved = project / "recipes/tiny_cpu/checkpoints/step_1"
    assert (saved / "COMPLETE.json").is_file() and (saved / "rng" / "rank_3.pt").is_file()


def test_a_checkpoint_folder_on_each_nodes_own_disk_is_refused_naming_node1(nodes):
    """Node-local checkpoint folders would hold one node's shards each: refused at start."""
    for project in nodes:
        _set_checkpoint_dir(project, "checkpoints")
    try:
        runs = _run_two_nodes(nodes)
    finally:
        for project in nodes:
            _set_checkpoint_dir(project, None)
    out = _output(runs)
    assert all(run.returncode != 0 for run in runs), out
    assert "training.checkpoint.dir" in out and "is not one folder every rank sees: rank(s) [2, 3] (node 1)" in out, out
    assert not (nodes[1] / "recipes/tiny_cpu/checkpoints").exists() or \
        not any((nodes[1] / "recipes/tiny_cpu/checkpoints").glob("step_*"))


def test_a_stale_node1_bundle_is_replaced(nodes):
    node0, node1 = nodes
    meta_path = node1 / BUNDLE / META_FILE
    meta = json.loads(meta_path.read_text())
    meta["signature"] = "0" * 64  # another recipe's bundle, as a node's disk may hold
    meta_path.write_text(json.dumps(meta))
    runs = _run_two_nodes(nodes)
    assert all(run.returncode == 0 for run in runs), _output(runs)
    assert bundle_bytes(node0 / BUNDLE) == bundle_bytes(node1 / BUNDLE)
    assert "node 1: installed rank 0's bundle" in _output(runs) and "copy was stale" in _output(runs)


def test_an_edited_node1_copy_is_refused_naming_node1s_ranks(nodes):
    node0, node1 = nodes
    modeling = next((node1 / BUNDLE).glob("modeling_*.py"))
    modeling.write_text(modeling.read_text() + "\n# edited on node 1\n")
    edited = bundle_bytes(node1 / BUNDLE)
    runs = _run_two_nodes(nodes)
    out = _output(runs)
    assert all(run.returncode != 0 for run in runs), out
    assert "integrity check on rank(s) [2, 3] (node 1)" in out, out
    assert bundle_bytes(node1 / BUNDLE) == edited  # refused, not silently repaired


def test_rank0s_failure_reaches_every_rank(tmp_path):
    nodes = []
    for node in range(2):
        project = make_project(tmp_path / f"node{node}")
        _two_node_recipe(project)
        recipe = project / TINY_RECIPE
        data = yaml.safe_load(recipe.read_text())
        data["plan_overrides"] = [{"match": "model.layers.0.no_such_module", "params": {"weight": {"tp": "replicate"}}}]
        recipe.write_text(yaml.safe_dump(data, sort_keys=False))
        nodes.append(project)
    runs = _run_two_nodes(nodes)
    out = _output(runs)
    assert all(run.returncode != 0 for run in runs), out
    assert "rank 0 failed to generate" in runs[1].stdout + runs[1].stderr, out  # node 1 got rank 0's message
    assert "no_such_module" in runs[1].stdout + runs[1].stderr, out


def test_a_node_with_another_model_config_is_refused_on_every_rank(tmp_path):
    """Node 1's config.json differs: its recipe projects to another bundle signature, and
    every rank stops (rank 0's node too), naming node 1's ranks."""
    nodes = []
    for node in range(2):
        project = make_project(tmp_path / f"node{node}")
        _two_node_recipe(project)
        nodes.append(project)
    config = nodes[1] / "recipes/tiny_cpu/models/tiny-qwen3-moe/config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    runs = _run_two_nodes(nodes)
    out = _output(runs)
    assert all(run.returncode != 0 for run in runs), out
    assert "rank 2 (node 1): its recipe projects to bundle signature" in runs[0].stdout + runs[0].stderr, out
