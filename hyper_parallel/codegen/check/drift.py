"""Drift: does the installed bundle still match the recipe and its own meta? Torch-free."""

from pathlib import Path

from hyper_parallel.codegen.bundle_folder import META_FILE
from hyper_parallel.codegen.hash import sha256_file
from hyper_parallel.codegen.meta import MetaError, load_codegen_meta
from hyper_parallel.codegen.spec.project import signature_from_spec
from hyper_parallel.codegen.spec.types import CodegenSpec


def fix_command(spec: CodegenSpec) -> str:
    """The command that regenerates the bundle, run from here: the recipe path relative to
    the working directory when it lies under it (what a user pastes), else absolute."""
    recipe = Path(spec.recipe_path)
    try:
        recipe = recipe.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        pass
    return f"doit generate config={recipe}"


def bundle_file_problems(bundle_dir: Path, meta: dict) -> list[str]:
    """Files listed in the meta that are missing or whose sha256 differs, and remote-code
    siblings the source records that the bundle does not carry unchanged."""
    problems = sibling_problems(bundle_dir, meta)
    for name, expected in meta["outputs"].items():
        path = bundle_dir / name
        if not path.is_file():
            problems.append(f"{path}: missing (listed in codegen_meta.json)")
            continue
        actual = sha256_file(path)
        if actual != expected:
            problems.append(f"{path}: sha256 mismatch: codegen_meta.json expects {expected}, "
                            f"the file has {actual}")
    return problems


def sibling_problems(bundle_dir: Path, meta: dict) -> list[str]:
    """Every sibling of a remote-code source must be listed in ``outputs`` with the
    sha256 it was resolved with (the bundle carries it byte for byte)."""
    problems = []
    outputs = meta["outputs"]
    for name, expected in (meta["source"].get("siblings") or []):
        if name not in outputs:
            problems.append(f"{bundle_dir / META_FILE}: outputs: remote-code sibling {name} of "
                            f"{meta['source'].get('file')} is not part of the bundle")
        elif outputs[name] != expected:
            problems.append(f"{bundle_dir / META_FILE}: outputs: sibling {name}: expected the sha256 "
                            f"resolved from the model folder {expected}, listed {outputs[name]}")
    return problems


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
