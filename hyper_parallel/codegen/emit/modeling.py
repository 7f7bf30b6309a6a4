"""emit: the generated modeling file (DESIGN §6).

    banner                      what was generated from what, and what the runtime owns
    the HF source, edited       relative imports made absolute, runtime import added,
                                replacements applied before self.post_init()
    HYPER_SOURCE_MODULE
    HYPER_REPLACEMENTS          (only when the recipe replaces modules)
    HYPER_PARALLEL_PLAN
    def hyper_parallelize(model, mesh_context)

Everything outside the edited spans is the HF source byte for byte.
"""

import textwrap
from collections.abc import Sequence
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

from hyper_parallel.codegen.astkit import SourceModule, apply_text_edits
from hyper_parallel.codegen.emit.imports import (
    RemoteCode,
    absolute_import_edits,
    add_imports_edit,
    remote_import_edits,
)
from hyper_parallel.codegen.emit.parallel import check_frozen_plan, render_parallel_section
from hyper_parallel.codegen.emit.replacement import render_replacements, replacement_call_edits
from hyper_parallel.config.plan_override import PlanOverride, replacement_entries

RUNTIME_IMPORT = "from hyper_parallel.codegen import runtime as hyper_parallel_runtime"
REPLACEMENTS_IMPORT = "from hyper_parallel.codegen.runtime import hyper_apply_replacements"
BANNER_KEYS = ("recipe", "signature", "source_sha256", "transformers_version", "parallel_dims")
RUNTIME_OWNS = ("device mesh construction", "data parallel (FSDP2)", "pipeline parallel splitting",
                "activation checkpointing", "torch.compile")
_RULE = "# " + "-" * 86 + "\n"
_BANNER_WIDTH = 86
_VALUE_COLUMN = len("recorded only:   ")


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
    edits.append(add_imports_edit(source, [RUNTIME_IMPORT] + ([REPLACEMENTS_IMPORT] if entries else [])))
    if entries:
        edits += replacement_call_edits(source)
    body = apply_text_edits(source_text, edits)
    if not body.endswith("\n"):
        body += "\n"

    text = (render_banner(banner, source_module, frozen_plan, has_replacements=bool(entries), remote=remote)
            + body + render_tail(source_module, entries, frozen_plan))
    try:
        compile(text, f"<generated from {source_module}>", "exec")
    except SyntaxError as exc:  # a bug here, not in the inputs: say where
        raise ValueError(f"generated modeling file for {source_module} does not compile: {exc}") from None
    return text


def render_tail(source_module: str, entries: list[dict[str, Any]], plan: dict[str, Any]) -> str:
    parts = [
        "\n\n" + _RULE
        + "# hyper-parallel codegen: everything below is generated from the recipe.\n" + _RULE + "\n"
        "# The HF module this file was generated from; replacements use it to match the\n"
        "# recipe's module_type against the classes defined here.\n"
        f'HYPER_SOURCE_MODULE = "{source_module}"\n\n'
    ]
    if entries:
        parts.append(render_replacements(entries) + "\n")
    parts.append(render_parallel_section(plan))
    return "".join(parts)


def render_banner(banner: dict[str, Any], source_module: str, plan: dict[str, Any], *,
                  has_replacements: bool, remote: RemoteCode | None = None) -> str:
    _check_banner(banner)
    dims = " ".join(f"{key}={value}" for key, value in banner["parallel_dims"].items())
    recorded = "; ".join(f"{axis} ({why})" for axis, why in plan["recorded_axes"].items()) or "none"
    if remote is None:
        edits = ["relative imports made absolute; hyper_parallel runtime import added"]
        origin = []
    else:
        edits = ["imports of siblings kept relative (the siblings are copied into this folder)",
                 "other relative imports made absolute; hyper_parallel runtime import added"]
        siblings = ", ".join(f"{name}.py" for name in remote.siblings) or "none"
        origin = [f"source origin:   remote code ({source_module}.py in the model folder)",
                  f"siblings:        {siblings} (copied into this folder unchanged)"]
    if has_replacements:
        edits.append("replace_module entries applied before self.post_init() (HYPER_REPLACEMENTS)")
    edits.append("HYPER_PARALLEL_PLAN and hyper_parallelize() appended")
    lines = [
        "Generated by hyper-parallel codegen. Do not edit; regenerate with:",
        f"    doit generate config=<path to {PurePosixPath(banner['recipe']).name}>",
        "",
        f"recipe:          {banner['recipe']} (relative to this folder)",
        f"signature:       {banner['signature']}",
        f"source module:   {source_module}",
        *origin,
        f"source sha256:   {banner['source_sha256']}",
        f"transformers:    {banner['transformers_version']}",
        f"parallel dims:   {dims}",
        f"applied axes:    {', '.join(plan['applied_axes']) or 'none'}",
        f"recorded only:   {recorded}",
        f"runtime owns:    {', '.join(RUNTIME_OWNS)}",
        "edits to the HF source:" if remote is None else "edits to the remote source:",
        *(f"  - {edit}" for edit in edits),
    ]
    wrapped = [part for line in lines for part in _wrap(line)]
    return _RULE + "".join(f"# {line}".rstrip() + "\n" for line in wrapped) + _RULE + "\n"


def _wrap(line: str) -> list[str]:
    """Long ``label:   value`` lines continue under the value, never splitting words
    (a signature or path stays whole)."""
    if len(line) <= _BANNER_WIDTH:
        return [line]
    return textwrap.wrap(line, width=_BANNER_WIDTH, subsequent_indent=" " * _VALUE_COLUMN,
                         break_long_words=False, break_on_hyphens=False)


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
