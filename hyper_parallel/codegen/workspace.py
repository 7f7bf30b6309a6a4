"""A recipe's workspace: where each stage's output lives (``StageFiles``, as the stage
table places them), how a stage record is written and read (sealed with the sha256 of its
own content, so an edited record is stale), the signatures the records were built from,
files written only when their bytes change (the early cutoff), and the clean-up of what a
killed run left. Torch-free; the stage runners (``stages.py``) write through it.
"""

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyper_parallel.codegen.bundle_folder import BundleError
from hyper_parallel.codegen.hash import sha256_json
from hyper_parallel.codegen.spec.types import CodegenSpec
from hyper_parallel.codegen.stage_table import SIGNATURES_FILE, STAGED_DIR, WORKSPACE_ENTRIES, stage_row
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.launch.processes import pid_alive

_TEMP_FILE = re.compile(r"^\..+\.(\d+)\.tmp$")  # write_if_changed's temp files, named after their writer


class StageRecordError(FileNotFoundError, HyperParallelError):
    """An earlier stage's output is missing, unreadable or edited."""


@dataclass(frozen=True)
class StageFiles:
    """Where a recipe's stage outputs live, as the stage table places them."""

    spec: CodegenSpec

    @property
    def staged(self) -> Path:
        """The staged bundle (emit's and diff's files), inside the recipe's workspace."""
        return self.spec.workspace / STAGED_DIR

    def output(self, name: str) -> Path:
        """The record stage ``name`` writes: in the workspace, or the installed bundle's meta."""
        row = stage_row(name)
        return (self.spec.bundle_dir if row.in_bundle else self.spec.workspace) / row.output_name

    def upstream(self, name: str) -> list[Path]:
        """The outputs of the earlier stages that stage ``name`` reads."""
        return [self.output(earlier) for earlier in stage_row(name).reads]


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def read_upstream(path: Path) -> dict[str, Any]:
    """An earlier stage's output, which must exist as that stage wrote it (doit and
    run_pipeline order the stages; an edited one is refused)."""
    value = read_stage_record(path)
    if value is None:
        raise StageRecordError(f"{path}: missing, unreadable or edited output of an earlier stage; "
                                f"run the whole pipeline (`doit generate config=...`)")
    return value


def recorded_signatures(spec: CodegenSpec) -> dict[str, str]:
    """stage -> the signature its current record was built from (empty when none)."""
    return read_json(spec.workspace / SIGNATURES_FILE) or {}


def write_stage_record(path: Path, record: dict[str, Any]) -> None:
    """A stage's output, sealed with the sha256 of its own content: an edited output
    (a hand-changed plan.json) is stale, so it is rebuilt, never passed on."""
    write_json(path, {**record, "content_sha256": sha256_json(record)})


def read_stage_record(path: Path) -> dict[str, Any] | None:
    """A stage output whose content is what its stage wrote, else None."""
    record = read_json(path)
    if record is None:
        return None
    body = {key: value for key, value in record.items() if key != "content_sha256"}
    return body if record.get("content_sha256") == sha256_json(body) else None


def write_json(path: Path, value: dict[str, Any]) -> None:
    write_if_changed(path, (json.dumps(value, indent=1, sort_keys=False) + "\n").encode())


def write_if_changed(path: Path, data: bytes) -> None:
    """Leave identical files untouched (mtime too): the early cutoff for later stages."""
    if path.is_file() and path.read_bytes() == data:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def check_workspace_owned(workspace: Path) -> None:
    """Clean removes a recipe's workspace only when it holds nothing but stage outputs."""
    if workspace.is_symlink():
        raise BundleError(f"cannot remove the workspace {workspace}: it is a symbolic link (to "
                            f"{os.readlink(workspace)}); nothing was changed")
    known = WORKSPACE_ENTRIES
    foreign = sorted(e.name for e in workspace.iterdir()
                     if e.is_symlink() or (e.name not in known and not _TEMP_FILE.match(e.name)))
    if foreign:
        raise BundleError(f"cannot remove the workspace {workspace}: it holds {len(foreign)} entr(ies) the "
                            f"pipeline did not write ({', '.join(foreign[:10])}); nothing was changed; move them out")


def remove_orphaned_temp_files(workspace: Path) -> list[Path]:
    """Temp files a killed run left in the workspace (their writer is gone)."""
    removed = []
    for folder in (workspace, workspace / STAGED_DIR):
        if not folder.is_dir() or folder.is_symlink():
            continue
        for entry in folder.iterdir():
            found = _TEMP_FILE.match(entry.name)
            if found and entry.is_file() and not entry.is_symlink() and not pid_alive(int(found.group(1))):
                entry.unlink(missing_ok=True)
                removed.append(entry)
    return removed
