"""project_codegen_spec(config) and the signatures computed from it.

Nothing here imports torch or transformers: every doit up-to-date check runs it.
"""

import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hyper_parallel.codegen.hash import implementation_sha256, runner_parts, sha256_file, sha256_json
from hyper_parallel.codegen.source.resolver import SourceError, SourceLocation, locate_source, read_model_config
from hyper_parallel.codegen.spec.types import CodegenSpec
from hyper_parallel.codegen.stage_table import WORKSPACE_ENV, stage_row
from hyper_parallel.config.loading import RecipeError
from hyper_parallel.config.model_files import ModelLocationError, model_location
from hyper_parallel.config.schema import TrainerConfig
from hyper_parallel.config.workspace import default_workspace_root

SPEC_SCHEMA = 1


def model_token(model_type: str) -> str:
    """``qwen3_moe`` → ``Qwen3_Moe`` (the seed's naming rule)."""
    return "_".join(part[:1].upper() + part[1:] for part in re.split(r"[_\-]", model_type) if part)


def modeling_file_name(model_type: str, device_type: str) -> str:
    return f"modeling_{model_token(model_type)}_gen_{device_type}.py"


RECIPES_DIR = "recipes"  # the project's recipes: what `doit generate` and `check --all` take


def project_recipes(root: Path | str = ".") -> list[str]:
    """Every recipe under ``<root>/recipes`` (relative paths, sorted), leaving out model
    folders and installed bundles: the recipes whose committed bundles the gate checks."""
    base = Path(root)
    return [path.relative_to(base).as_posix() for path in sorted((base / RECIPES_DIR).rglob("*.y*ml"))
            if not {"generated", "models"} & set(path.relative_to(base).parts)]


def recipe_id(recipe_path: Path, root: Path) -> str:
    """The recipe's workspace name: its path relative to ``root``, one-to-one (two recipes
    never share a workspace). Folders are joined by ``+``; ``.yaml`` is dropped (any other
    suffix is kept, marked by a trailing ``~``); a character outside ``[A-Za-z0-9_.-]``,
    a leading dot and ``~``/``+`` themselves are written ``~XX`` (UTF-8 bytes in hex)."""
    *folders, name = Path(os.path.relpath(recipe_path, root)).parts
    stem, marker = (name[:-5], "") if name.endswith(".yaml") and len(name) > 5 else (name, "~")
    rid = "+".join([*map(_escape_id_part, folders), _escape_id_part(stem) + marker])
    # A folder name has at most 255 bytes; "~~" never occurs in an escaped id.
    return rid if len(rid) <= 200 else f"{rid[:150]}~~{hashlib.sha256(rid.encode()).hexdigest()[:16]}"


def _escape_id_part(part: str) -> str:
    """Safe characters as they are, every other one (``~`` and ``+`` too) and a leading
    dot as ``~XX`` per UTF-8 byte."""
    escaped = "".join(ch if re.fullmatch(r"[A-Za-z0-9_.-]", ch) else "".join(f"~{b:02X}" for b in ch.encode())
                      for ch in part)
    return "~2E" + escaped[1:] if escaped.startswith(".") else escaped


def project_codegen_spec(config: TrainerConfig, *, workspace_root: str | Path | None = None) -> CodegenSpec:
    """Project the recipe onto what codegen consumes. Reads config.json and locates the
    model source (the resolve stage hashes it); writes nothing."""
    if not config._yaml_path:
        raise RecipeError("project_codegen_spec needs a config read by load_training_config (no _yaml_path)")
    recipe_path = Path(config._yaml_path)
    yaml_dir = recipe_path.parent
    where = str(recipe_path)
    try:
        location_of_model = model_location(config)
    except ModelLocationError as exc:
        raise RecipeError(str(exc)) from None
    model_dir = location_of_model.folder
    model_config = read_model_config(model_dir, recipe=where, key="model.pretrained_model_name_or_path")
    acc = config.accelerator
    bundle_link = Path(os.path.abspath(yaml_dir / (config.model.codegen_artifact_dir or "generated")))
    _refuse_symlink(bundle_link, where, "model.codegen_artifact_dir", "the bundle folder")
    bundle_dir = bundle_link.resolve()
    root = Path(workspace_root).resolve() if workspace_root else default_workspace_root()
    rid = recipe_id(recipe_path, root.parent)
    _refuse_symlink(root / rid, where, f"${WORKSPACE_ENV}", "the recipe's workspace")
    _check_bundle_dir(bundle_dir, yaml_dir=yaml_dir, model_dir=model_dir, workspace=root / rid, where=where)
    location = locate_source(model_dir, model_config)
    if location.is_remote and not config.model.trust_remote_code:
        raise SourceError(f"{where}: model.trust_remote_code: the model folder {model_dir} brings its own code "
                          f"({location.file}, named by auto_map in config.json); codegen imports and runs it only "
                          f"with model.trust_remote_code: true")
    modeling_file = modeling_file_name(model_config["model_type"], acc.device_type)
    _check_sibling_names(location, modeling_file, model_dir)
    return CodegenSpec(
        recipe_path=recipe_path,
        recipe_rel=os.path.relpath(recipe_path, bundle_dir).replace(os.sep, "/"),
        model_dir=model_dir,
        model_dir_rel=location_of_model.display,
        model_config=model_config,
        model_config_sha256=sha256_file(model_dir / "config.json"),
        config_overrides=dict(sorted(config.model.config_overrides.items())),
        torch_dtype=config.model.torch_dtype,
        attn_implementation=config.model.attn_implementation,
        location=location,
        layout=acc.layout,
        device_type=acc.device_type,
        plan_overrides=tuple(config.plan_overrides),
        bundle_dir=bundle_dir,
        bundle_dir_rel=os.path.relpath(bundle_dir, yaml_dir).replace(os.sep, "/"),
        modeling_file=modeling_file,
        workspace=root / rid,
        recipe_id=rid,
        check_timeout_s=acc.check_timeout_s,
        recipe_overrides=tuple(config._overrides),
    )


def _check_sibling_names(location: SourceLocation, modeling_file: str, model_dir: Path) -> None:
    """Siblings are copied into the bundle next to the generated file: names must not clash."""
    for name in location.sibling_names:
        if name == modeling_file:
            raise SourceError(f"{model_dir / name}: a remote-code sibling has the generated modeling file's "
                              f"name {modeling_file!r}; rename it (the bundle holds both)")


def _refuse_symlink(path: Path, where: str, key: str, what: str) -> None:
    """Install replaces and clean removes these folders: through a link they would act on
    a folder codegen never made."""
    if path.is_symlink():
        raise RecipeError(f"{where}: {key}: {what} {path} is a symbolic link (to {os.readlink(path)}); expected a "
                          f"real folder of codegen's own; replace the link by a folder, or point {key} elsewhere")


def _check_bundle_dir(bundle_dir: Path, *, yaml_dir: Path, model_dir: Path, workspace: Path, where: str) -> None:
    """The bundle folder is replaced wholesale on install and removed by clean: it must be
    a folder of its own, never one that holds the recipe, the model or the workspace."""
    def inside(path: Path, folder: Path) -> bool:
        return path == folder or folder in path.parents

    clash = ("the recipe's folder" if inside(yaml_dir, bundle_dir) else
             "the model folder" if inside(model_dir, bundle_dir) or inside(bundle_dir, model_dir) else
             "the pipeline workspace" if inside(workspace, bundle_dir) or inside(bundle_dir, workspace) else None)
    if clash:
        raise RecipeError(f"{where}: model.codegen_artifact_dir: the bundle folder {bundle_dir} would contain or "
                          f"overlap {clash}; expected a folder of its own (default: generated/ beside the recipe)")


# --- signatures ---------------------------------------------------------------------------

def bundle_signature_inputs(spec: CodegenSpec) -> dict[str, Any]:
    """Exactly the recipe-side inputs that can change a bundle's bytes. The
    codegen implementation's hash is not among them: it decides when stages rerun (the
    stage signatures, in the workspace), while the committed bundle changes only when
    what is emitted changes."""
    return {
        "schema": SPEC_SCHEMA,
        "source": spec.source.identity(),
        "model": {"dir": spec.model_dir_rel, "config_sha256": spec.model_config_sha256,
                  "config_overrides": spec.config_overrides},
        "parallel": spec.parallel_record(),
        "plan_overrides": spec.plan_overrides_json,
        "bundle": {"dir": spec.bundle_dir_rel, "modeling_file": spec.modeling_file,
                     "device_type": spec.device_type, "recipe": spec.recipe_rel},
    }


def signature_from_spec(spec: CodegenSpec) -> str:
    """The bundle signature recorded in codegen_meta.json."""
    return sha256_json(bundle_signature_inputs(spec))


# The recipe facts a stage's output can depend on, by the names the stage table uses.
SPEC_FACTS: dict[str, Callable[[CodegenSpec], Any]] = {
    "source": lambda spec: spec.source.identity(),
    "model_dir": lambda spec: spec.model_dir_rel,
    "config_sha256": lambda spec: spec.model_config_sha256,
    "parallel": lambda spec: spec.parallel_record(),
    "plan_overrides": lambda spec: spec.plan_overrides_json,
    "config_overrides": lambda spec: spec.config_overrides,
    "bundle_signature": signature_from_spec,
    "modeling_file": lambda spec: spec.modeling_file,
    "attn_implementation": lambda spec: spec.attn_implementation,
    "world_size": lambda spec: spec.layout.world_size,
}


def stage_signature(spec: CodegenSpec, name: str, upstream: dict[str, str]) -> str:
    """Signature of one stage: its own recipe facts (the stage table's ``facts``), the
    sha256 of the upstream files it reads (``upstream``: name → sha256) and the code it runs."""
    row = stage_row(name)
    own = {fact: SPEC_FACTS[fact](spec) for fact in row.facts}
    return sha256_json({"stage": name, "inputs": own, "upstream": upstream,
                        "implementation_sha256": implementation_sha256(runner_parts(row.runner, row.dynamic))})
