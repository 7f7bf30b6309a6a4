"""The bundle an install replaced, kept in the workspace until preflight passes.

Install swaps the verified bundle in before preflight runs (preflight checks what
training will import: the installed files, across ranks). A bundle whose preflight
fails must not stay installed for the next start to import, so install first keeps
what it replaces (``replaced_bundle.json``: every file's bytes, or that there was no
bundle) together with the sha256 of the meta it is about to install. When preflight
fails on that very bundle, the kept one is swapped back in atomically (or the new one
removed, where there was none) and the record dropped; when preflight passes, the
record is dropped. A record whose bundle is no longer the installed one (another
install or a hand edit since) restores nothing. Torch-free.
"""

import base64
import logging
import shutil

from hyper_parallel.codegen.bundle_folder import check_owned, write_bundle_atomic
from hyper_parallel.codegen.spec.types import CodegenSpec
from hyper_parallel.codegen.stage_table import REPLACED_FILE
from hyper_parallel.codegen.workspace import read_json, write_json
from hyper_parallel.digest import sha256_bytes, sha256_file
from hyper_parallel.runtime.meta import META_FILE, MetaError, load_codegen_meta

_LOG = logging.getLogger(__name__)


def keep_replaced_bundle(spec: CodegenSpec, new_meta: bytes) -> None:
    """Before install writes ``new_meta``'s bundle: record the installed one (None when
    the folder holds no readable bundle) and which meta will replace it."""
    files = None
    try:
        meta = load_codegen_meta(spec.bundle_dir)
        names = [*sorted(meta["outputs"]), META_FILE]
        files = {name: base64.b64encode((spec.bundle_dir / name).read_bytes()).decode() for name in names}
    except (MetaError, OSError, KeyError):
        files = None  # nothing complete to go back to: a failed preflight removes the new bundle
    write_json(spec.workspace / REPLACED_FILE, {"replaced_by": sha256_bytes(new_meta), "files": files})


def drop_replaced_bundle(spec: CodegenSpec) -> None:
    """Preflight passed: the installed bundle stays; what it replaced is forgotten."""
    (spec.workspace / REPLACED_FILE).unlink(missing_ok=True)


def restore_replaced_bundle(spec: CodegenSpec) -> str | None:
    """Preflight failed: put back what install replaced, if the failed bundle is the one
    that replaced it. Returns what was done, for the error message (None: nothing)."""
    record = read_json(spec.workspace / REPLACED_FILE)
    meta_path = spec.bundle_dir / META_FILE
    if record is None or not meta_path.is_file() or sha256_file(meta_path) != record.get("replaced_by"):
        return None
    files = record.get("files")
    if files is None:
        check_owned(spec.bundle_dir, "remove")
        shutil.rmtree(spec.bundle_dir)
        done = f"the bundle it failed on was removed from {spec.bundle_dir} (there was none before)"
    else:
        data = {name: base64.b64decode(text) for name, text in files.items()}
        write_bundle_atomic(spec.bundle_dir, {n: b for n, b in data.items() if n != META_FILE}, data[META_FILE])
        done = f"the previous bundle is back in {spec.bundle_dir}, byte for byte"
    drop_replaced_bundle(spec)
    _LOG.warning(f"[preflight] failed: {done}")
    return done
