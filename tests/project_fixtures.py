"""Build a throwaway copy of the project's doit entry point and recipes, and run the
real tools (doit, the CLI) in it as subprocesses."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hyper_parallel.testing.light_boot import NO_TORCH_BOOT

REPO = Path(__file__).resolve().parents[1]
TINY_RECIPE = "recipes/tiny_cpu/qwen3_moe_tiny.yaml"
MAIN_RECIPE = "recipes/qwen3_moe.yaml"


def make_project(dest: Path) -> Path:
    """dodo.py + recipes/ (no build outputs) copied into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "dodo.py", dest / "dodo.py")
    shutil.copytree(REPO / "recipes", dest / "recipes",
                    ignore=shutil.ignore_patterns("generated", "__pycache__"))
    return dest


def run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if env is None or key not in env:
            full_env.pop(key, None)
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def doit(project: Path, *args: str, env: dict | None = None, forbid_torch: bool = False) -> subprocess.CompletedProcess:
    if forbid_torch:
        return run([sys.executable, "-c", NO_TORCH_BOOT, *args], project, env)
    return run([sys.executable, "-m", "doit", *args], project, env)


def cli(project: Path, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "hyper_parallel.codegen", *args], project, env, timeout=timeout)


_TASK_LINE = re.compile(r"^(\.|--)\s+(\w+):(\S+)", re.M)


def tasks_ran(output: str) -> list[str]:
    """Stage names doit executed (lines ``.  stage:recipe``), in order."""
    return [m.group(2) for m in _TASK_LINE.finditer(output) if m.group(1) == "."]


def tasks_skipped(output: str) -> list[str]:
    return [m.group(2) for m in _TASK_LINE.finditer(output) if m.group(1) == "--"]


def verify_report(project: Path, recipe: Path) -> dict:
    """The figures of the last verify of ``recipe`` (a recipe under ``project``, built with
    the default workspace ``project/generated``): the workspace's verify.json keeps them,
    codegen_meta.json only says how verify ran."""
    from hyper_parallel.codegen.spec.project import recipe_id

    rid = recipe_id(Path(recipe).resolve(), Path(project).resolve())
    return json.loads((Path(project) / "generated" / rid / "verify.json").read_text())["report"]


def verify_in_both_modes(project: Path, recipe: Path) -> dict[str, tuple[str, dict, dict]]:
    """Generate ``recipe`` with verify's ranks as torchrun processes, then as threads of one
    process (the process cap forced to 1); per mode the output, verify's figures and what
    codegen_meta.json says of verify. Each run must pass and say the mode it ran in."""
    from hyper_parallel.codegen.check.verify_mode import MAX_PROCS_ENV

    verified = {}
    for mode, cap in (("torchrun", "64"), ("threads", "1")):
        proc = cli(project, "--verbose", "generate", "--force", "--skip-preflight", "--config", str(recipe),
                   env={MAX_PROCS_ENV: cap})
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        assert f"({mode})" in out, out
        meta = json.loads((Path(recipe).parent / "generated" / "codegen_meta.json").read_text())
        verified[mode] = out, verify_report(project, recipe), meta["verified"]
    return verified


def bundle_bytes(bundle: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(bundle.iterdir()) if p.is_file()}


def tree_state(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root`` (``__pycache__`` aside): a file's bytes, a link's target,
    ``<dir>`` for a folder. Equal before and after a run: nothing on disk changed."""
    state: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(root).as_posix()
        state[rel] = f"-> {os.readlink(path)}" if path.is_symlink() else "<dir>" if path.is_dir() else path.read_bytes()
    return state


def orphaned_scratch(settle_s: float = 15.0) -> list[str]:
    """verify/preflight scratch folders whose owning process is gone (live ones belong to
    other runs): a run must remove its own, even when it is killed. A killed run's watcher
    removes its folder within moments, so a folder is reported only when it outlives
    ``settle_s``: another test running at the same time (pytest-xdist) may be inside that
    moment, a leak is not."""
    from hyper_parallel.launch.processes import pid_alive

    deadline = time.monotonic() + settle_s
    while True:
        found = []
        for path in Path(tempfile.gettempdir()).glob("hp-*-*-*"):
            pid = path.name.split("-")[2]
            if pid.isdigit() and not pid_alive(int(pid)) and path.exists():
                found.append(path.name)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.25)
