"""Installing a bundle atomically (DESIGN §4).

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
import os
import shutil
import uuid
from pathlib import Path

META_FILE = "codegen_meta.json"
_TEMP_PREFIX = ".hp-bundle-"  # only dirs named <prefix><bundle>-<dead pid>-* are ever removed
_RENAME_EXCHANGE = 2


class ArtifactError(OSError):
    """The bundle directory cannot be written."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()  # the message, without an "[Errno N]" prefix


def write_bundle_atomic(artifact_dir: str | os.PathLike, files: dict[str, bytes], meta: bytes) -> Path:
    """Install ``files`` plus ``codegen_meta.json`` as the bundle at ``artifact_dir``."""
    target = Path(artifact_dir)
    parent = target.parent
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
        _swap_in(staging, target)
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
        if int(pid_text) != os.getpid() and _pid_alive(int(pid_text)):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _cannot_write(target: Path, exc: OSError) -> ArtifactError:
    """A one-line reason for an OSError met while creating ``target``'s staging dir."""
    where = exc.filename or target.parent
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        reason = f"{where} is not writable ({exc.strerror})"
    elif exc.errno in (errno.EEXIST, errno.ENOTDIR):
        reason = f"{where} exists and is not a directory"
    else:
        reason = f"{where}: {exc.strerror}"
    return ArtifactError(exc.errno, f"cannot write the bundle {target}: {reason}; fix the path or set "
                                    f"model.codegen_artifact_dir in the recipe")


def looks_like_bundle(path: Path) -> bool:
    """True for an empty folder or one codegen wrote (it has a codegen_meta.json, or only
    files a bundle holds). Install and clean never replace or remove anything else."""
    if not path.is_dir():
        return False
    names = {entry.name for entry in path.iterdir()}
    if not names or META_FILE in names:
        return True
    return all(name in ("__init__.py", "__pycache__") or name.startswith("modeling_") for name in names)


def _swap_in(staging: Path, target: Path) -> None:
    if target.is_dir() and not looks_like_bundle(target):
        raise ArtifactError(errno.EEXIST, f"cannot install the bundle at {target}: the folder holds files "
                                          f"codegen did not write; set model.codegen_artifact_dir to a folder "
                                          f"of its own")
    try:
        os.rename(staging, target)  # no bundle yet (or an empty dir): plain atomic rename
        return
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:  # target is a file: never replace something not a bundle
            raise ArtifactError(exc.errno, f"cannot install the bundle at {target}: it exists and is "
                                           f"not a directory; remove it or set "
                                           f"model.codegen_artifact_dir in the recipe") from None
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR):
            raise
    try:
        _exchange(staging, target)  # staging now holds the old bundle; the caller removes it
    except ExchangeUnsupported:
        _replace_by_two_renames(staging, target)


class ExchangeUnsupported(OSError):
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
        raise ArtifactError(err, f"cannot swap the new bundle into {b}: {os.strerror(err)}")


def _replace_by_two_renames(staging: Path, target: Path) -> None:
    """The old bundle aside (named like a staging dir, so a killed run's is cleaned up
    by the next install), the new one in, the old one removed."""
    aside = staging.with_name(staging.name + "-old")
    os.rename(target, aside)
    try:
        os.rename(staging, target)
    except OSError as exc:
        os.rename(aside, target)  # put the old bundle back
        raise ArtifactError(exc.errno, f"cannot move the new bundle into {target}: {exc.strerror}") from None
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
