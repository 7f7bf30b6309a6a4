"""A decoder-only family nobody has seen, shipped as remote code (auto_map in its
config.json), generates from a recipe alone: the bundle carries its siblings, imports
through the loader, passes the torchrun preflight, and after its hyper_parallelize() at
tp 2 computes the single-process remote model's loss and gradients. A sibling's bytes
are a codegen input: changing them reruns every stage."""

import json
import math
import shutil
import socket

import pytest
import torch
from safetensors.torch import save_file

from hyper_parallel.runtime.integrity import PreflightError, preflight_integrity_check
from hyper_parallel.codegen.hash import sha256_file
from hyper_parallel.runtime.loader import bundle_package_name, load_generated_module
from hyper_parallel.codegen.manager import load_spec
from hyper_parallel.runtime.meta import load_codegen_meta
from hyper_parallel.codegen.plan.derive import build_meta_model
from tests.launch import assert_ran, torchrun
from tests.project_fixtures import REPO, cli, doit, tasks_ran
from tests.remote_code.remote_project import (
    BUNDLE,
    MODEL_DIR,
    MODELING_FILE,
    OFFLINE_ENV,
    RECIPE,
    SIBLING,
    make_remote_project,
)
from tests.remote_code.remote_tp_worker import build_remote_model

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

THROUGH_INSTALL = ["resolve", "derive", "freeze", "emit", "diff", "verify", "install"]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """The remote-code recipe generated once from nothing, offline, through the torchrun
    preflight, by ``doit generate`` (test_changed_sibling_reruns_every_stage goes on from
    a copy of it: doit's state is part of the project)."""
    project = make_remote_project(tmp_path_factory.mktemp("remote") / "project")
    proc = doit(project, "generate", f"config={RECIPE}", env=OFFLINE_ENV)
    return project, proc


def test_generate_with_preflight_succeeds_offline(generated):
    project, proc = generated
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert tasks_ran(proc.stdout) == THROUGH_INSTALL + ["preflight"], proc.stdout
    bundle = project / BUNDLE
    assert sorted(p.name for p in bundle.iterdir()) == sorted(
        ["__init__.py", "codegen_meta.json", SIBLING, MODELING_FILE, MODELING_FILE + ".diff"])
    assert (bundle / SIBLING).read_bytes() == (project / MODEL_DIR / SIBLING).read_bytes()
    meta = load_codegen_meta(bundle)
    assert meta["outputs"][SIBLING] == sha256_file(bundle / SIBLING)
    assert meta["source"]["origin"] == "remote" and meta["source"]["file"] == "modeling_fused.py"
    assert meta["source"]["siblings"] == [[SIBLING, sha256_file(project / MODEL_DIR / SIBLING)]]
    assert meta["model"]["model_class"] == "FusedDecoderForCausalLM"
    assert str(project) not in (bundle / "codegen_meta.json").read_text()
    text = (bundle / MODELING_FILE).read_text()
    assert "\nfrom .configuration_fused import FusedDecoderConfig\n" in text
    banner = " ".join(line[1:].strip() for line in text.split("\n\n", 1)[0].splitlines())
    assert "siblings copied unchanged into this folder: configuration_fused.py" in banner, banner
    assert (bundle / (MODELING_FILE + ".diff")).read_text().startswith(
        "--- a/models/fused_decoder/modeling_fused.py\n")


def test_bundle_imports_its_siblings_inside_the_synthetic_package(generated, tmp_path):
    project, proc = generated
    assert proc.returncode == 0, proc.stderr[-3000:]
    bundle = tmp_path / "generated"
    shutil.copytree(project / BUNDLE, bundle)
    report = preflight_integrity_check(bundle)
    module = load_generated_module(bundle)
    package = bundle_package_name(bundle)
    assert module.__name__ == f"{package}.{MODELING_FILE[:-3]}"
    assert module.FusedDecoderConfig.__module__ == f"{package}.configuration_fused"
    assert module.FusedDecoderForCausalLM.config_class is module.FusedDecoderConfig
    assert report["plan_entries"] == len(module.HYPER_PARALLEL_PLAN["modules"])
    # preflight and training build the generated class with the bundle's own config class
    spec = load_spec(project / RECIPE, project / "generated")
    model, config = build_meta_model(spec, module.FusedDecoderForCausalLM)
    assert type(config) is module.FusedDecoderConfig and type(model) is module.FusedDecoderForCausalLM

    (bundle / SIBLING).write_text((bundle / SIBLING).read_text() + "\n# edited by hand\n")
    with pytest.raises(PreflightError) as err:
        preflight_integrity_check(bundle)
    assert f"{bundle / SIBLING}: sha256 mismatch" in str(err.value), str(err.value)


def test_generated_model_at_tp2_equals_single_process_remote_model(generated, tmp_path):
    project, proc = generated
    assert proc.returncode == 0, proc.stderr[-3000:]
    model_dir = project / MODEL_DIR
    torch.manual_seed(2024)
    reference, _ = build_remote_model(str(model_dir))
    weights = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(weights))

    out = torchrun(["-m", "tests.remote_code.remote_tp_worker",
                    "--bundle", str(project / BUNDLE), "--model-dir", str(model_dir), "--weights", str(weights),
                    "--out", str(tmp_path)], cwd=REPO, env=OFFLINE_ENV)
    assert_ran(out)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["generated_class_module"].startswith("hyper_parallel_generated."), result
        assert result["config_class_module"].endswith(".configuration_fused"), result
        assert result["reference_class_module"].startswith("transformers_modules."), result
        assert math.isclose(result["gen_loss"], result["ref_loss"], rel_tol=1e-5), result
        assert result["grad_failures"] == [], result["grad_failures"]
        assert result["grads_checked"] == result["param_count"] == 21, result
        # [q | k | v] of 3 * 64 rows: each rank holds its 32 rows of each part (a packed shard)
        assert result["qkv_local_shape"] == [96, 64], result


def test_changed_sibling_reruns_every_stage(generated, tmp_path):
    # The first doit run from nothing is the module's (every stage ran: the test above);
    # a copy of its project goes on from there.
    built, first = generated
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert tasks_ran(first.stdout)[:len(THROUGH_INSTALL)] == THROUGH_INSTALL
    project = shutil.copytree(built, tmp_path / "project", symlinks=True)
    again = doit(project, "install", f"config={RECIPE}", env=OFFLINE_ENV, forbid_torch=True)
    assert again.returncode == 0 and tasks_ran(again.stdout) == [], again.stdout

    sibling = project / MODEL_DIR / SIBLING
    sibling.write_text(sibling.read_text() + "\n# a new comment: new bytes, same behaviour\n")
    out = doit(project, "install", f"config={RECIPE}", env=OFFLINE_ENV)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # Every stage whose input changed: freeze's (derive's plan) did not, so it is cut off.
    assert tasks_ran(out.stdout) == [s for s in THROUGH_INSTALL if s != "freeze"], out.stdout
    assert (project / BUNDLE / SIBLING).read_bytes() == sibling.read_bytes()
    assert load_codegen_meta(project / BUNDLE)["outputs"][SIBLING] == sha256_file(sibling)


def test_derive_builds_the_remote_model_without_the_network(tmp_path, monkeypatch):
    project = make_remote_project(tmp_path / "project")
    spec = load_spec(project / RECIPE, project / "generated")
    attempts = []

    def refuse(self, address, *args):
        attempts.append(address)
        raise OSError(f"network access attempted: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    model, config = build_meta_model(spec)
    assert attempts == []
    assert type(model).__name__ == "FusedDecoderForCausalLM"
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    assert type(config).__name__ == "FusedDecoderConfig"
    assert model.lm_head.weight.device.type == "meta"


MIXER = '''

class FusedMixer(nn.Module):
    """A raw square weight applied with a matmul: nothing says how to shard it."""

    def __init__(self, size):
        super().__init__()
        self.mixer = nn.Parameter(torch.eye(size))

    def forward(self, hidden):
        return hidden @ self.mixer


class FusedAttention(nn.Module):'''


def test_unclassifiable_remote_module_fails_generation_naming_it(tmp_path):
    # Outside the decoder layers (inside one, its part of the layers would be left whole:
    # tests/families/test_unseen_family.py).
    project = make_remote_project(tmp_path / "project")
    modeling = project / MODEL_DIR / "modeling_fused.py"
    text = modeling.read_text().replace("\n\nclass FusedAttention(nn.Module):", MIXER, 1)
    text = text.replace("        self.norm = FusedRMSNorm(config.hidden_size, eps=config.rms_norm_eps)\n",
                        "        self.norm = FusedRMSNorm(config.hidden_size, eps=config.rms_norm_eps)\n"
                        "        self.mix = FusedMixer(config.hidden_size)\n", 1)
    assert "self.mix = FusedMixer" in text
    modeling.write_text(text)
    proc = cli(project, "generate", "--config", RECIPE, "--skip-preflight", env=OFFLINE_ENV)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "model.mix" in output and "FusedMixer" in output and "cannot classify" in output, output[-3000:]
    assert not (project / BUNDLE).exists()
