"""Drift: does the installed bundle still match the recipe and its own meta? Torch-free."""

from pathlib import Path

from hyper_parallel.codegen.spec.project import signature_from_spec
from hyper_parallel.codegen.spec.types import CodegenSpec
from hyper_parallel.runtime.integrity import bundle_file_problems
from hyper_parallel.runtime.meta import META_FILE, MetaError, load_codegen_meta


def fix_command(spec: CodegenSpec) -> str:
    """The command that regenerates the bundle, run from here: the recipe path relative to
    the working directory when it lies under it (what a user pastes), else absolute."""
    recipe = Path(spec.recipe_path)
    try:
        recipe = recipe.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        pass
    return f"doit generate config={recipe}"


def installed_bundle_problems(spec: CodegenSpec) -> list[str]:
    """Empty when the installed bundle is the one this recipe would generate."""
    try:
        meta = load_codegen_meta(spec.bundle_dir)
    except MetaError as exc:
        return [str(exc)]
    problems = []
    expected = signature_from_spec(spec)
    if meta["signature"] != expected:
        problems.append(
            f"{spec.bundle_dir / META_FILE}: signature mismatch: the recipe "
            f"{spec.recipe_path.name} now gives {expected}, the bundle was built for {meta['signature']} "
            f"(a codegen input changed since generation)")
    if meta.get("modeling_file") != spec.modeling_file:
        problems.append(f"{spec.bundle_dir / META_FILE}: modeling_file: expected "
                        f"{spec.modeling_file!r}, got {meta.get('modeling_file')!r}")
    return problems + bundle_file_problems(spec.bundle_dir, meta)
