"""Import an installed bundle as a synthetic package, without touching sys.path.

The package name is stable per artifact directory (a hash of its absolute path), so
two bundles never collide in ``sys.modules`` and re-importing the same bundle reuses
the module. A failed import leaves nothing behind in ``sys.modules``. Remote-code
siblings copied into the bundle are submodules of that package, so the generated
file's ``from .configuration_x import ...`` finds the bundle's copy.
"""

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from hyper_parallel.codegen.meta import MetaError, load_codegen_meta

PACKAGE_PREFIX = "hyper_parallel_generated"


class BundleImportError(ImportError):
    """The generated modeling file could not be imported."""


def bundle_package_name(artifact_dir: str | Path, signature: str | None = None) -> str:
    """``hyper_parallel_generated._<folder hash>_<signature>``: stable for one installed
    bundle; a reinstall with another signature imports afresh instead of reusing the old
    module. Without ``signature`` it is read from the bundle's meta (when readable)."""
    artifact_dir = Path(artifact_dir).resolve()
    digest = hashlib.sha256(str(artifact_dir).encode()).hexdigest()[:16]
    if signature is None:
        try:
            signature = load_codegen_meta(artifact_dir)["signature"]
        except MetaError:
            signature = ""
    return f"{PACKAGE_PREFIX}._{digest}" + (f"_{str(signature)[:12]}" if signature else "")


def load_generated_module(artifact_dir: str | Path) -> ModuleType:
    """The bundle's modeling module (e.g. ``modeling_Qwen3_Moe_gen_npu``)."""
    artifact_dir = Path(artifact_dir).resolve()
    meta = load_codegen_meta(artifact_dir)
    return load_bundle_module(artifact_dir, meta["modeling_file"], meta["signature"])


def load_bundle_module(bundle_dir: str | Path, modeling_file: str, key: str) -> ModuleType:
    """The modeling module of a bundle folder, installed or staged (no meta yet): ``key``
    (the bundle's signature, or a hash of the staged files) names the package, so other
    bytes in the same folder import afresh."""
    bundle_dir = Path(bundle_dir).resolve()
    package = bundle_package_name(bundle_dir, key)
    name = f"{package}.{modeling_file[:-3]}"
    if name in sys.modules:
        return sys.modules[name]
    _ensure_root_package()
    try:
        _import_package(package, bundle_dir)
        return importlib.import_module(name)
    except Exception as exc:
        for stale in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
            del sys.modules[stale]
        raise BundleImportError(f"{bundle_dir / modeling_file}: import failed: "
                                f"{type(exc).__name__}: {exc}") from exc


def _ensure_root_package() -> None:
    if PACKAGE_PREFIX not in sys.modules:
        root = ModuleType(PACKAGE_PREFIX)
        root.__path__ = []  # namespace for bundles; nothing is ever found on it directly
        sys.modules[PACKAGE_PREFIX] = root


def _import_package(package: str, artifact_dir: Path) -> ModuleType:
    if package in sys.modules:
        return sys.modules[package]
    spec = importlib.util.spec_from_file_location(
        package, artifact_dir / "__init__.py", submodule_search_locations=[str(artifact_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[package] = module
    spec.loader.exec_module(module)
    return module
