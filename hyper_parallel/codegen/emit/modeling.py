"""emit: the generated modeling file.

    banner                      what was generated from what, and what the runtime owns
    the HF source, edited       relative imports made absolute, runtime import added,
                                replacements applied before self.post_init()
    HYPER_REPLACEMENTS          after the imports (only when the recipe replaces modules)
    HYPER_SOURCE_MODULE
    HYPER_PARALLEL_PLAN
    def hyper_parallelize(model, mesh_context)

Everything outside the edited spans is the HF source byte for byte.
"""

from collections.abc import Sequence
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

from hyper_parallel.codegen.astkit import SourceModule, TextEdit, apply_text_edits
from hyper_parallel.codegen.emit.imports import (
    RemoteCode,
    absolute_import_edits,
    add_imports_edit,
    remote_import_edits,
)
from hyper_parallel.codegen.emit.literal import comment_block
from hyper_parallel.codegen.emit.parallel import check_frozen_plan, render_parallel_section
from hyper_parallel.codegen.emit.replacement import render_replacements, replacement_call_edits
from hyper_parallel.config.plan_override import PlanOverride, replacement_entries

RUNTIME_IMPORT = "from hyper_parallel import runtime as hyper_parallel_runtime"
BANNER_KEYS = ("recipe", "transformers_version", "parallel_dims")
RUNTIME_OWNS = ("the device mesh", "data parallel (FSDP2)", "running the pipeline stages (the plan records the split)",
                "activation checkpointing", "torch.compile")
_RULE = "# " + "-" * 98 + "\n"
# transformers' banner on files generated from a modular_*.py: a rule of sirens, the text, a rule.
_HF_BANNER_RULE = "\U0001F6A8"
_HF_BANNER_TEXT = "This file was automatically generated from"
_HF_BANNER_MAX_LINES = 8


def emit_modeling_source(*, source_text: str, source_module: str, banner: dict[str, Any],
                         frozen_plan: dict[str, Any], overrides: Sequence[PlanOverride] = (),
                         remote: RemoteCode | None = None) -> str:
    """The generated modeling file for the HF module ``source_module`` (its text is
    ``source_text``). ``banner`` needs :data:`BANNER_KEYS`; ``frozen_plan`` is the
    freeze stage's output; ``overrides`` are the recipe's entries as the loader checked
    them (those with ``replace_module`` are lowered). ``remote`` is set for remote code
    from the model folder (``source_module`` is then its module name there, e.g. ``modeling_fused``):
    imports of its siblings stay relative. Same inputs give the same bytes."""
    check_frozen_plan(frozen_plan)
    entries = replacement_entries(overrides)
    source = SourceModule.parse(source_text, source_module)

    edits = remote_import_edits(source, remote) if remote else absolute_import_edits(source, source_module)
    edits += hf_banner_edits(source_text)
    edits.append(add_imports_edit(source, [RUNTIME_IMPORT],
                                  trailer=render_replacements(entries) if entries else ""))
    if entries:
        edits += replacement_call_edits(source)
    body = apply_text_edits(source_text, edits)
    if not body.endswith("\n"):
        body += "\n"

    text = (render_banner(banner, source_module, frozen_plan, has_replacements=bool(entries), remote=remote)
            + body + render_tail(source_module, frozen_plan))
    try:
        compile(text, f"<generated from {source_module}>", "exec")
    except SyntaxError as exc:  # a bug here, not in the inputs: say where
        raise ValueError(f"generated modeling file for {source_module} does not compile: {exc}") from None
    return text


def hf_banner_edits(source_text: str) -> list[TextEdit]:
    """Drop transformers' "automatically generated from modular_X.py ... One of our CI
    enforces this" banner: it is false for the generated file, whose own banner says
    where it comes from (the license header below it stays)."""
    lines = source_text.splitlines(keepends=True)
    head = lines[:_HF_BANNER_MAX_LINES]
    if not head or _HF_BANNER_RULE not in head[0] or not any(_HF_BANNER_TEXT in line for line in head):
        return []
    closing = next((i for i in range(1, len(head)) if _HF_BANNER_RULE in head[i]), None)
    if closing is None or not all(line.startswith("#") for line in head[:closing + 1]):
        return []
    return [TextEdit(0, sum(map(len, head[:closing + 1])), "", why="transformers' modular banner")]


def render_tail(source_module: str, plan: dict[str, Any]) -> str:
    return ("\n\n# ---- hyper-parallel codegen: everything below is generated from the recipe " + "-" * 41 + "\n"
            + "\n# The module this file was generated from (replacements match module_type against its classes).\n"
            f'HYPER_SOURCE_MODULE = "{source_module}"\n\n' + render_parallel_section(plan))


def render_banner(banner: dict[str, Any], source_module: str, plan: dict[str, Any], *,
                  has_replacements: bool, remote: RemoteCode | None = None) -> str:
    """The file's one banner: what it was generated from, what was changed and how to
    regenerate it. Signatures and hashes live in codegen_meta.json only, so a codegen
    change that emits the same code leaves this file's bytes alone."""
    _check_banner(banner)
    dims = " ".join(f"{key}={value}" for key, value in banner["parallel_dims"].items())
    recorded = "; ".join(f"{axis} ({why})" for axis, why in plan["recorded_axes"].items()) or "none"
    version = banner["transformers_version"]
    if remote is None:
        origin = f"From {source_module} (transformers {version}), edited: this banner replaces transformers' own,"
        edits = ["relative imports made absolute"]
    else:
        siblings = ", ".join(f"{name}.py" for name in remote.siblings) or "none"
        origin = (f"From {source_module}.py, remote code in the model folder (transformers {version}; siblings "
                  f"copied unchanged into this folder: {siblings}), edited: this banner added,")
        edits = ["imports of the siblings kept relative, other relative imports made absolute"]
    if has_replacements:
        edits.append("HYPER_REPLACEMENTS applied before self.post_init()")
    edits.append("HYPER_PARALLEL_PLAN and hyper_parallelize() appended.")
    lines = [
        f"Generated by hyper-parallel codegen from the recipe {banner['recipe']} (relative to this folder); do not "
        "edit: regenerate with doit generate config=<that recipe>. Signature and file hashes: codegen_meta.json.",
        f"{origin} {', '.join(edits)}",
        f"Parallel: {dims}; applied: {', '.join(plan['applied_axes']) or 'none'}; recorded only: {recorded}. "
        f"The trainer owns: {', '.join(RUNTIME_OWNS)}.",
    ]
    return _RULE + comment_block(lines) + _RULE + "\n"


def _check_banner(banner: dict[str, Any]) -> None:
    missing = [key for key in BANNER_KEYS if key not in banner]
    if missing:
        raise ValueError(f"banner: missing keys {missing}; expected {list(BANNER_KEYS)}")
    recipe = str(banner["recipe"])
    if PurePosixPath(recipe).is_absolute() or PureWindowsPath(recipe).is_absolute():
        raise ValueError(f"banner.recipe: expected a relative path (bundles must survive moving "
                         f"the checkout), got {recipe!r}")
    if not isinstance(banner["parallel_dims"], dict):
        raise ValueError(f"banner.parallel_dims: expected a mapping, got {banner['parallel_dims']!r}")
    for key, value in banner.items():
        if "\n" in str(value) or "\r" in str(value):
            raise ValueError(f"banner.{key}: must be a single line, got {value!r}")
