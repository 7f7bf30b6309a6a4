"""Shared by the pipeline tests: generated tiny projects built once per pytest run, copied
into each test that changes them, and a small synthetic bundle for loader tests."""

import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from hyper_parallel.codegen.bundle_folder import write_bundle_atomic
from hyper_parallel.codegen.hash import sha256_bytes
from hyper_parallel.runtime.meta import META_SCHEMA_VERSION, REQUIRED_META_FIELDS
from tests.project_fixtures import REPO, TINY_RECIPE, cli, doit, make_project

# The package is not installed: subprocesses started in a project copy find it here.
ENV = {"PYTHONPATH": str(REPO)}
BUNDLE = Path("recipes/tiny_cpu/generated")
MODELING_FILE = "modeling_Qwen3_Moe_gen_cpu.py"

_generated: dict[str, Path] = {}  # the projects generated in this pytest run, by name


def generated_tiny_project(tmp_path_factory) -> Path:
    """A project whose tiny recipe is generated through install (no torchrun preflight).
    Built once per pytest run, also under pytest-xdist: the first worker to ask builds it
    under a lock in the run's shared temp folder, the others wait and reuse it. Treat it
    as read-only and copy it to change it."""
    def build(project: Path) -> str:
        proc = cli(project, "generate", "--config", TINY_RECIPE, "--skip-preflight", env=ENV)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout + proc.stderr

    return _built_once(tmp_path_factory, "generated-tiny", build)[0]


def doit_generated_tiny_project(tmp_path_factory) -> tuple[Path, str]:
    """A project whose tiny recipe ``doit generate`` built from nothing, through the torchrun
    preflight (doit's state database included), and that run's output. Built once per
    pytest run like generated_tiny_project; read-only: copy it (symlinks kept) to change or
    to run doit in it."""
    def build(project: Path) -> str:
        proc = doit(project, "generate", f"config={TINY_RECIPE}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout + proc.stderr

    return _built_once(tmp_path_factory, "doit-generated-tiny", build)


def _built_once(tmp_path_factory, name: str, build: Callable[[Path], str]) -> tuple[Path, str]:
    """``build`` run once per pytest run in a fresh project (dodo.py and recipes/) named
    ``name``, under a lock in the run's shared temp folder; the project and the output
    ``build`` returned."""
    if name not in _generated:
        root = _run_temp(tmp_path_factory)
        project, done = root / name / "project", root / f"{name}.done"
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                shutil.rmtree(project.parent, ignore_errors=True)  # a failed build's remains
                make_project(project)
                done.write_text(build(project))
        _generated[name] = project
    return _generated[name], (_run_temp(tmp_path_factory) / f"{name}.done").read_text()


def _run_temp(tmp_path_factory) -> Path:
    """This pytest run's temp folder, shared by its xdist workers (each worker's own
    base temp folder sits inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def copy_project(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def fake_meta(files: dict[str, bytes], modeling_file: str, signature: str = "0" * 64) -> bytes:
    """A codegen_meta.json with every required field, listing ``files`` by sha256."""
    meta = {field: {} for field in REQUIRED_META_FIELDS}
    meta.update(schema_version=META_SCHEMA_VERSION, signature=signature, recipe="../recipe.yaml",
                modeling_file=modeling_file, not_covered=[],
                outputs={name: sha256_bytes(data) for name, data in sorted(files.items())})
    return (json.dumps(meta, indent=2) + "\n").encode()


def install_fake_bundle(bundle_dir: Path, body: str, modeling_file: str = "modeling_fake.py",
                        signature: str = "0" * 64) -> Path:
    """A torch-free bundle: ``__init__.py`` and a modeling file holding ``body``."""
    files = {"__init__.py": b'"""fake bundle"""\n', modeling_file: body.encode()}
    return write_bundle_atomic(bundle_dir, files, fake_meta(files, modeling_file, signature))
