"""The bundle's folder: installing a bundle atomically, and what in the
folder codegen can prove it wrote (install and clean touch nothing else).

All files are written into a hidden sibling temp directory, ``codegen_meta.json``
last, then the directory is swapped in. With an existing bundle the swap is one
``renameat2(RENAME_EXCHANGE)`` call, so a reader sees the old complete bundle or the
new complete one — even if this process is killed at any instant. Where the file
system or the OS has no exchange (NFS, some overlay file systems, non-Linux), the old
bundle is renamed aside and the new one renamed in: a reader may then briefly find no
bundle, never a mixed one. Leftover temp directories from a killed run are removed by
the next install.
"""

import ctypes
import ctypes.util
import errno
import json
import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

from hyper_parallel.errors import HyperParallelError
from hyper_parallel.launch.processes import pid_alive  # noqa: F401 (stale staging folders; tests use it)
from hyper_parallel.runtime.meta import META_FILE
_TEMP_PREFIX = ".hp-bundle-"  # only dirs named <prefix><bundle>-<dead pid>-* are ever removed
_RENAME_EXCHANGE = 2


class BundleError(OSError, HyperParallelError):
    """The bundle directory cannot be written."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()  # the message, without an "[Errno N]" prefix


def write_bundle_atomic(bundle_dir: str | os.PathLike, files: dict[str, bytes], meta: bytes) -> Path:
    """Install ``files`` plus ``codegen_meta.json`` as the bundle at ``bundle_dir``."""
    target = Path(bundle_dir)
    parent = target.parent
    check_owned(target, "install", files)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging_dirs(target)
        staging = parent / f"{_TEMP_PREFIX}{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
    except OSError as exc:
        raise _cannot_write(target, exc) from None
    try:
        for name in sorted(files):
            _write_synced(staging / name, files[name])
        _write_synced(staging / META_FILE, meta)
        _fsync_dir(staging)
        _swap_in(staging, target, files)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def remove_stale_staging_dirs(target: Path) -> list[Path]:
    """Remove temp dirs a killed install left beside ``target``. A temp dir whose writer
    is still alive is left alone, as is anything without our prefix."""
    removed = []
    prefix = f"{_TEMP_PREFIX}{target.name}-"
    for entry in target.parent.glob(prefix + "*"):
        pid_text = entry.name[len(prefix):].split("-", 1)[0]
        if not entry.is_dir() or entry.is_symlink() or not pid_text.isdigit():
            continue
        if int(pid_text) != os.getpid() and pid_alive(int(pid_text)):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _cannot_write(target: Path, exc: OSError) -> BundleError:
    """A one-line reason for an OSError met while creating ``target``'s staging dir."""
    where = exc.filename or target.parent
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        reason = f"{where} is not writable ({exc.strerror})"
    elif exc.errno in (errno.EEXIST, errno.ENOTDIR):
        reason = f"{where} exists and is not a directory"
    else:
        reason = f"{where}: {exc.strerror}"
    return BundleError(exc.errno, f"cannot write the bundle {target}: {reason}; fix the path or set "
                                    f"model.codegen_artifact_dir in the recipe")


def foreign_entries(folder: Path, installing: Iterable[str] = ()) -> list[str]:
    """What in ``folder`` codegen cannot prove it wrote — install and clean refuse while
    this is not empty, and never replace or remove any of it. Proof is the bundle's own
    manifest: ``codegen_meta.json`` and the regular files its ``outputs`` list (or, when a
    manifest is there but damaged, the files this install writes), plus Python's
    ``__pycache__`` of ``.pyc`` files. Without a manifest, only an empty folder is
    codegen's. An edited listed file is still codegen's (generate rewrites it)."""
    if folder.is_symlink() or not folder.is_dir():
        return []
    has_manifest = (folder / META_FILE).is_file() and not (folder / META_FILE).is_symlink()
    ours = {META_FILE, *_manifest_names(folder), *(installing if has_manifest else ())}
    foreign = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.is_symlink():
            foreign.append(f"{entry.name} (a symbolic link)")
        elif entry.name == "__pycache__" and entry.is_dir() and _only_bytecode(entry):
            continue
        elif entry.name not in ours or not entry.is_file():
            foreign.append(entry.name + ("/" if entry.is_dir() else ""))
    return foreign


def _manifest_names(folder: Path) -> set[str]:
    try:
        outputs = json.loads((folder / META_FILE).read_text(encoding="utf-8")).get("outputs")
    except (OSError, ValueError, AttributeError):
        return set()
    return {name for name in outputs if isinstance(name, str) and "/" not in name} if isinstance(outputs, dict) else set()


def _only_bytecode(folder: Path) -> bool:
    return all(e.is_file() and not e.is_symlink() and e.suffix == ".pyc" for e in folder.iterdir())


def check_owned(folder: Path, action: str, installing: Iterable[str] = ()) -> None:
    """Refuse (naming what is in the way) unless ``folder`` is absent or codegen's own."""
    if folder.is_symlink():
        raise BundleError(errno.EEXIST, f"cannot {action} the bundle at {folder}: it is a symbolic link (to "
                                          f"{os.readlink(folder)}); codegen writes only a real folder of its own; "
                                          f"replace the link by a folder or set model.codegen_artifact_dir")
    if folder.exists() and not folder.is_dir():
        raise BundleError(errno.ENOTDIR, f"cannot {action} the bundle at {folder}: it exists and is not a "
                                           f"directory; remove it or set model.codegen_artifact_dir in the recipe")
    foreign = foreign_entries(folder, installing)
    if foreign:
        shown = ", ".join(foreign[:10]) + (f" and {len(foreign) - 10} more" if len(foreign) > 10 else "")
        raise BundleError(errno.EEXIST, f"cannot {action} the bundle at {folder}: it holds {len(foreign)} "
                                          f"file(s) codegen did not write ({shown}); nothing was changed; move "
                                          f"them out or set model.codegen_artifact_dir to a folder of its own")


REPLACE_ENV = "HYPER_PARALLEL_REPLACE_BUNDLE"  # "1": a recipe may replace another recipe's tracked bundle


def check_not_anothers_tracked_bundle(folder: Path, recipe_rel: str, fix: str) -> None:
    """Refuse, before any stage runs, to replace the bundle another recipe of the same folder
    made when git tracks it (a copied example recipe would rewrite the committed bundle):
    recipes that share a folder share one bundle, but replacing a reviewed one is asked for
    by name (``REPLACE_ENV=1``) or avoided with ``model.codegen_artifact_dir``."""
    meta = folder / META_FILE
    if os.environ.get(REPLACE_ENV) == "1" or not meta.is_file():
        return
    try:
        owner = json.loads(meta.read_text()).get("recipe")
    except (OSError, ValueError):
        return
    if owner in (None, recipe_rel) or not _tracked_by_git(meta):
        return
    raise BundleError(errno.EEXIST, f"{folder} holds the bundle of {owner}, which git tracks; generating "
                                    f"{recipe_rel} there would replace it (recipes in one folder share one "
                                    f"bundle); nothing was changed; fix: set model.codegen_artifact_dir in "
                                    f"{recipe_rel.rpartition('/')[2]} to a folder of its own (e.g. generated_"
                                    f"{Path(recipe_rel).stem}), or rerun with {REPLACE_ENV}=1 to replace it "
                                    f"({fix})")


def _tracked_by_git(path: Path) -> bool:
    """Whether ``path`` is a file git tracks (False where git or a repository is absent)."""
    import subprocess

    try:
        return subprocess.run(["git", "ls-files", "--error-unmatch", path.name], cwd=path.parent,
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def check_creatable(folder: Path) -> None:
    """Refuse, before any stage runs, a bundle folder that cannot be made: its nearest
    existing ancestor is a file (the install would find out after derive and verify)."""
    for ancestor in folder.parents:
        if ancestor.exists() or ancestor.is_symlink():
            if not ancestor.is_dir():
                raise _cannot_write(folder, OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(ancestor)))
            return


def _swap_in(staging: Path, target: Path, installing: Iterable[str]) -> None:
    check_owned(target, "install", installing)  # again, right before the swap
    try:
        os.rename(staging, target)  # no bundle yet (or an empty dir): plain atomic rename
        return
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:  # target is a file: never replace something not a bundle
            raise BundleError(exc.errno, f"cannot install the bundle at {target}: it exists and is "
                                           f"not a directory; remove it or set "
                                           f"model.codegen_artifact_dir in the recipe") from None
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR):
            raise
    try:
        _exchange(staging, target)  # staging now holds the old bundle; the caller removes it
    except ExchangeUnsupported:
        _replace_by_two_renames(staging, target)


class ExchangeUnsupported(OSError, HyperParallelError):
    """This file system or OS cannot exchange two paths in one call."""


def _exchange(a: Path, b: Path) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        raise ExchangeUnsupported(errno.ENOSYS, "no renameat2 in this C library")
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise ExchangeUnsupported(err, os.strerror(err))
        raise BundleError(err, f"cannot swap the new bundle into {b}: {os.strerror(err)}")


def _replace_by_two_renames(staging: Path, target: Path) -> None:
    """The old bundle aside (named like a staging dir, so a killed run's is cleaned up
    by the next install), the new one in, the old one removed."""
    aside = staging.with_name(staging.name + "-old")
    os.rename(target, aside)
    try:
        os.rename(staging, target)
    except OSError as exc:
        os.rename(aside, target)  # put the old bundle back
        raise BundleError(exc.errno, f"cannot move the new bundle into {target}: {exc.strerror}") from None
    shutil.rmtree(aside, ignore_errors=True)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
