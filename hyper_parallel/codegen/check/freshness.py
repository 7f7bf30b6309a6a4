"""The freshness gate (``doit check``, ``python -m hyper_parallel.codegen check``): is the
committed bundle, byte for byte, what ``generate`` would install now?

Bundles of the recipes under ``recipes/`` are committed so that their diff is reviewed
in the pull request; CI regenerates them in its workspace and fails, with the unified
diff of every stale file, when what is committed differs (transformers does the same
for its generated modeling files). The comparison runs the stages through ``diff`` in
the workspace (incremental: a current workspace runs none) and builds the meta that
install would write; verify is not rerun for it, since its record in the meta is a
function of the layout (``expected_verified``).
"""

import difflib
from dataclasses import dataclass
from pathlib import Path

from hyper_parallel.codegen.check.drift import fix_command, installed_bundle_problems
from hyper_parallel.runtime.meta import MetaError, load_codegen_meta
from hyper_parallel.codegen.spec.types import CodegenSpec

_MAX_DIFF_LINES = 400  # per file: enough to review, not a wall


@dataclass(frozen=True)
class StaleFile:
    """One bundle file whose committed bytes differ from what generate writes now."""

    path: Path
    committed: bytes | None  # None: missing from the bundle
    expected: bytes | None  # None: generate would not write it

    def unified_diff(self) -> str:
        """The change that ``--fix`` (or ``doit generate``) would make, as a unified diff."""
        old, new = _text_lines(self.committed), _text_lines(self.expected)
        lines = list(difflib.unified_diff(old, new, fromfile=f"{self.path} (committed)",
                                          tofile=f"{self.path} (generate writes)", n=2))
        lines = [line if line.endswith("\n") else line + "\n" for line in lines]
        if len(lines) > _MAX_DIFF_LINES:
            lines = lines[:_MAX_DIFF_LINES] + [f"... {len(lines) - _MAX_DIFF_LINES} more diff lines\n"]
        return "".join(lines)


def _text_lines(data: bytes | None) -> list[str]:
    return [] if data is None else data.decode("utf-8", errors="replace").splitlines(keepends=True)


def transformers_mismatch(spec: CodegenSpec) -> str | None:
    """One line when the bundle was built with another transformers than the one
    installed: every file would differ, and the cause is the environment, not the code."""
    try:
        built_with = load_codegen_meta(spec.bundle_dir)["source"].get("transformers_version")
    except MetaError:
        return None
    installed = spec.source.transformers_version
    if built_with in (None, installed):
        return None
    return (f"{spec.bundle_dir}: built with transformers {built_with}, this environment has {installed}; "
            f"install the pinned versions (pip install -c constraints.txt ...) or regenerate: {fix_command(spec)}")


def stale_files(spec: CodegenSpec) -> list[StaleFile]:
    """Every file of the recipe's bundle folder whose bytes differ from what generate
    would install now (including files it would add or drop)."""
    from hyper_parallel.codegen.stages import expected_bundle

    expected = expected_bundle(spec)
    folder = spec.bundle_dir
    present = {p.name for p in folder.iterdir() if p.is_file()} if folder.is_dir() else set()
    stale = []
    for name in sorted(present | set(expected)):
        committed = (folder / name).read_bytes() if name in present else None
        if committed != expected.get(name):
            stale.append(StaleFile(folder / name, committed, expected.get(name)))
    return stale


def stale_report(spec: CodegenSpec) -> str | None:
    """The gate's failure for ``spec``: every problem and the command that fixes it; None
    when the committed bundle is current."""
    problems = freshness_problems(spec)
    if not problems:
        return None
    return "\n".join(problems) + f"\n  fix: {fix_command(spec)} (or: python -m hyper_parallel.codegen check --all --fix)"


def freshness_problems(spec: CodegenSpec) -> list[str]:
    """What the gate reports for one recipe (empty when the bundle is current): one line
    when there is no readable bundle or another transformers built it, else what its own
    meta says is wrong (a signature the recipe does not give, a file whose sha256 is not
    the listed one) and each stale file with its diff."""
    try:
        load_codegen_meta(spec.bundle_dir)
    except MetaError as exc:
        return [str(exc)]
    mismatch = transformers_mismatch(spec)
    if mismatch:
        return [mismatch]
    return installed_bundle_problems(spec) + [
        f"{stale.path}: stale (differs from what generate writes now):\n{stale.unified_diff().rstrip()}"
        for stale in stale_files(spec)]
