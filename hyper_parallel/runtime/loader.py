"""Import an installed bundle as a synthetic package, without touching sys.path.

The package name is stable per bundle directory (a hash of its absolute path), so
two bundles never collide in ``sys.modules`` and re-importing the same bundle reuses
the module. A failed import leaves nothing behind in ``sys.modules``. Remote-code
siblings copied into the bundle are submodules of that package, so the generated
file's ``from .configuration_x import ...`` finds the bundle's copy. Every module is
compiled from the sha256-checked bytes of a listed file: no bytecode cache, no search
path.
"""

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from hyper_parallel.digest import sha256_bytes
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.runtime.meta import MetaError, load_codegen_meta

PACKAGE_PREFIX = "hyper_parallel_generated"


class BundleImportError(ImportError, HyperParallelError):
    """The generated modeling file could not be imported."""


def bundle_package_name(bundle_dir: str | Path, signature: str | None = None) -> str:
    """``hyper_parallel_generated._<folder hash>_<signature>``: stable for one installed
    bundle; a reinstall with another signature imports afresh instead of reusing the old
    module. Without ``signature`` it is read from the bundle's meta (when readable)."""
    bundle_dir = Path(bundle_dir).resolve()
    digest = hashlib.sha256(str(bundle_dir).encode()).hexdigest()[:16]
    if signature is None:
        try:
            signature = load_codegen_meta(bundle_dir)["signature"]
        except MetaError:
            signature = ""
    return f"{PACKAGE_PREFIX}._{digest}" + (f"_{str(signature)[:12]}" if signature else "")


def load_generated_module(bundle_dir: str | Path) -> ModuleType:
    """The bundle's modeling module (e.g. ``modeling_Qwen3_Moe_gen_npu``)."""
    bundle_dir = Path(bundle_dir).resolve()
    meta = load_codegen_meta(bundle_dir)
    return load_bundle_module(bundle_dir, meta["modeling_file"], meta["signature"], meta["outputs"])


def load_bundle_module(bundle_dir: str | Path, modeling_file: str, key: str, files: Mapping[str, str]) -> ModuleType:
    """The modeling module of a bundle folder, installed or staged (no meta yet).

    ``files`` (name -> sha256: the meta's ``outputs``, or what emit staged) are the only
    modules of the package; each is compiled from the bytes just read, after their sha256
    is checked, so no bytecode cache and no other file on a search path can stand in for
    them. ``key`` (the signature, or a hash of the staged files) names the package, so
    other bytes in the same folder import afresh."""
    bundle_dir = Path(bundle_dir).resolve()
    package = bundle_package_name(bundle_dir, key)
    name = f"{package}.{modeling_file[:-3]}"
    if name in sys.modules:
        return sys.modules[name]
    _ensure_root_package()
    _BundleFinder.packages[package] = (bundle_dir, dict(files))
    try:
        _import_package(package, bundle_dir, files)
        return importlib.import_module(name)
    except Exception as exc:
        for stale in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
            del sys.modules[stale]
        raise BundleImportError(f"{bundle_dir / modeling_file}: import failed: "
                                f"{type(exc).__name__}: {exc}") from exc


class _VerifiedSource(importlib.abc.Loader):
    """Executes one bundle file from the bytes it reads, if they have the listed sha256."""

    def __init__(self, path: Path, sha256: str):
        self.path, self.sha256 = path, sha256

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module) -> None:
        data = self.path.read_bytes()
        actual = sha256_bytes(data)
        if actual != self.sha256:
            raise BundleImportError(f"{self.path}: sha256 {actual} differs from the bundle's {self.sha256}; "
                                    f"the file changed after it was written: run `doit generate`")
        exec(compile(data, str(self.path), "exec", dont_inherit=True), module.__dict__)


class _BundleFinder(importlib.abc.MetaPathFinder):
    """Finds a bundle package's submodules among its listed files, and nowhere else."""

    packages: dict[str, tuple[Path, dict[str, str]]] = {}

    def find_spec(self, fullname, path=None, target=None):
        package, _, leaf = fullname.rpartition(".")
        if package not in self.packages:
            return None
        bundle_dir, files = self.packages[package]
        if f"{leaf}.py" not in files:
            raise ModuleNotFoundError(f"{fullname}: {leaf}.py is not a file of the bundle {bundle_dir}",
                                      name=fullname)
        return _spec(fullname, bundle_dir / f"{leaf}.py", files[f"{leaf}.py"], package=False)


def _spec(name: str, path: Path, sha256: str, *, package: bool) -> importlib.machinery.ModuleSpec:
    spec = importlib.machinery.ModuleSpec(name, _VerifiedSource(path, sha256), origin=str(path), is_package=package)
    spec.has_location = True
    return spec


def _ensure_root_package() -> None:
    if PACKAGE_PREFIX not in sys.modules:
        root = ModuleType(PACKAGE_PREFIX)
        root.__path__ = []  # namespace for bundles; nothing is ever found on it directly
        sys.modules[PACKAGE_PREFIX] = root
    if not any(isinstance(finder, _BundleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BundleFinder())


def _import_package(package: str, bundle_dir: Path, files: Mapping[str, str]) -> ModuleType:
    if package in sys.modules:
        return sys.modules[package]
    if "__init__.py" not in files:
        raise BundleImportError(f"{bundle_dir}: __init__.py is not listed among the bundle's files")
    spec = _spec(package, bundle_dir / "__init__.py", files["__init__.py"], package=True)
    spec.submodule_search_locations = []  # submodules: only _BundleFinder, only listed files
    module = importlib.util.module_from_spec(spec)
    sys.modules[package] = module
    spec.loader.exec_module(module)
    return module
