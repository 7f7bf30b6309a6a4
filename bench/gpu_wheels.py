"""Wheels for a lent GPU machine, built here: ``python bench/gpu_wheels.py [--out build/gpu_wheels]``.

The one-GPU machines have their own torch (2.11 with CUDA) and no package registry. What the
GPU checks need beside torch is carried to them as wheels (the device tool carries ignored
folders such as ``build/``): this package (``pip wheel --no-deps .``), and transformers,
accelerate, doit and pytest with every dependency they have that torch's own environment
does not bring, at the versions installed here (``constraints.txt``). Pure-Python
packages come as their one ``py3-none-any`` wheel; the compiled ones (tokenizers,
safetensors, regex, PyYAML, psutil, ...) as manylinux x86_64 wheels for CPython 3.10 to
3.13, so whichever Python the machine has finds its own. ``bench/gpu_check.sh`` installs
them with ``pip install --no-index --no-deps --target`` into a folder it puts on
``PYTHONPATH``. Prints the folder's size (the device tool carries 64 MiB in all).
"""

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("transformers", "accelerate", "doit", "pytest")
# What torch's own environment brings (torch requires them), and torch itself: not carried.
WITH_TORCH = {"torch", "numpy", "filelock", "typing-extensions", "sympy", "mpmath", "networkx", "jinja2",
              "markupsafe", "fsspec", "setuptools", "triton"}
PYTHONS = ("310", "311", "312", "313")
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")


def closure(roots=ROOTS) -> dict[str, str]:
    """name -> installed version for ``roots`` and what they require (no extras), less
    what comes with torch."""
    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = _canonical(todo.pop())
        if name in found or name in WITH_TORCH or name.startswith("nvidia-"):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency this machine does not have either
        found[name] = dist.version
        for requirement in dist.requires or []:
            if "extra ==" in requirement:
                continue
            if ";" in requirement and not _applies(requirement.split(";", 1)[1]):
                continue
            todo.append(re.split(r"[\s<>=!~\[;(]", requirement, maxsplit=1)[0])
    return found


def _applies(marker: str) -> bool:
    from packaging.markers import Marker

    return Marker(marker).evaluate()


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def download(name: str, version: str, out: Path) -> None:
    """The pure wheel, or one compiled wheel per CPython version."""
    base = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(out)]
    if subprocess.run([*base, f"{name}=={version}", "--python-version", "3.11",
                       "--implementation", "py", "--abi", "none", "--platform", "any"]).returncode == 0:
        return
    for python in PYTHONS:
        platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
        subprocess.run([*base, f"{name}=={version}", "--python-version", python, "--implementation", "cp",
                        *platforms], check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "build" / "gpu_wheels"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(REPO)],
                   check=True)
    packages = closure()
    for name, version in sorted(packages.items()):
        print(f"{name}=={version}", flush=True)
        download(name, version, out)
    (out / "requirements.txt").write_text("".join(f"{name}=={version}\n" for name, version in sorted(packages.items()))
                                          + "hyper-parallel\n")
    size = sum(path.stat().st_size for path in out.iterdir())
    print(f"{out}: {len(list(out.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
