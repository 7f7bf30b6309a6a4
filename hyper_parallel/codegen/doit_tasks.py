"""doit task definitions (dodo.py takes them from ``task_creators``). Import-light: no torch here.

Each row of the stage table (``stage_table``) is one task per recipe. A task is up to
date when its recorded signature equals the one computed now (``stage_is_current``); ``file_dep`` on the previous
stage's output gives early cutoff, ``task_dep`` gives order (and lets ``doit clean``
walk the chain). Recipes come from ``config=PATH`` or, without it, every YAML under
``recipes/``.
"""

import os
import shutil
import sys
import traceback
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path

from doit import get_var
from doit.exceptions import TaskFailed

from hyper_parallel.codegen.spec.project import project_recipes, recipe_id
from hyper_parallel.codegen.stage_table import STAGE_TABLE, STAGES, WORKSPACE_DIR, is_read_by_a_later_stage, stage_row
from hyper_parallel.console_log import configure_console_logging

MIN_FREE_MB_ENV = "HYPER_PARALLEL_MIN_FREE_MB"
MIN_FREE_MB = 64  # doit's sqlite state and one recipe's stage outputs, with room to spare
ACTION_INDENT = "   "  # an action's lines sit under doit's ".  stage:recipe" line


def _workspace_ready(workspace: str) -> None:
    """doit opens its sqlite dependency file before any task runs: its folder must exist
    and have room, or doit dies in sqlite with a traceback. Checked here, one line, exit 2."""
    least = int(os.environ.get(MIN_FREE_MB_ENV, MIN_FREE_MB))
    try:
        existing = os.path.abspath(workspace)
        while not os.path.isdir(existing):
            existing = os.path.dirname(existing)
        free = shutil.disk_usage(existing).free
        if free >= least * 2**20:
            os.makedirs(workspace, exist_ok=True)
    except OSError as exc:
        _exit_bad_input(f"cannot create the pipeline workspace {os.path.abspath(workspace)}: {exc.strerror}; "
                        f"run doit from a writable project folder")
    if free < least * 2**20:
        _exit_bad_input(f"the pipeline workspace {os.path.abspath(workspace)} is on a disk with {free / 2**20:.0f} "
                        f"MiB free; doit's state and the stage outputs need at least {least} MiB "
                        f"(${MIN_FREE_MB_ENV}); free some space and run doit again")


def _exit_bad_input(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


_workspace_ready(WORKSPACE_DIR)  # relative to the folder doit runs in (where dodo.py is)

DOIT_CONFIG = {
    "default_tasks": ["generate"],
    "backend": "sqlite3",
    "dep_file": os.path.join(WORKSPACE_DIR, ".doit-db.sqlite"),
    "verbosity": 2,
    "action_string_formatting": "new",
}

def selected_recipes() -> list[str]:
    config = get_var("config")
    return [config] if config else project_recipes()


def _rid(path: str) -> str:
    return recipe_id(Path(path).resolve(), Path.cwd())


@lru_cache(maxsize=None)
def _spec(path: str, cwd: str, mtime_ns: int):
    """The recipe parsed and projected once per doit process (every stage's up-to-date
    check and action asks for it), again only when the file changes."""
    from hyper_parallel.codegen.manager import load_spec
    return load_spec(path, Path(cwd) / WORKSPACE_DIR)


def spec_for(path: str):
    """The spec of the recipe at ``path`` (relative to the folder doit runs in)."""
    return _spec(path, os.getcwd(), os.stat(path).st_mtime_ns)


def stage_uptodate(stage: str, path: str) -> bool:
    from hyper_parallel.codegen.stages import stage_is_current
    try:
        return stage_is_current(spec_for(path), stage)
    except Exception:
        return False  # the action runs and reports the problem


def run_stage_action(stage: str, path: str):
    from hyper_parallel.codegen.stages import keep_until_exit, run_stage
    configure_console_logging(indent=ACTION_INDENT)
    try:
        run_stage(spec_for(path), stage)
    except Exception as exc:
        return _failure(exc, path)
    finally:
        keep_until_exit()
    return None


def check_action(path: str):
    from hyper_parallel.codegen.check.freshness import stale_report
    from hyper_parallel.codegen.stages import check_installed
    configure_console_logging(indent=ACTION_INDENT)
    try:
        spec = spec_for(path)
        report = stale_report(spec)
        if report:
            return TaskFailed(report)
        check_installed(spec)
    except Exception as exc:
        return _failure(exc, path)
    return None


def clean_action(path: str, what: str) -> None:
    from hyper_parallel.codegen.manager import clean_recipe
    configure_console_logging(indent=ACTION_INDENT)
    try:
        clean_recipe(spec_for(path), what=(what,))
    except Exception as exc:
        print(f"{ACTION_INDENT}cannot clean {path}: {exc}")


def _failure(exc: Exception, path: str) -> TaskFailed:
    detail = traceback.format_exc() if os.environ.get("HYPER_PARALLEL_TRACEBACK") else ""
    return TaskFailed(f"{path}: {type(exc).__name__}: {exc}\n{detail}".rstrip())


def _workspace_file(path: str, name: str) -> str:
    return os.path.join(WORKSPACE_DIR, _rid(path), name)


def _workspace_outputs(path: str, names) -> list[str]:
    """The workspace records of stages ``names`` (an output in the bundle is no file doit
    tracks: install is judged by its own up-to-date check)."""
    return [_workspace_file(path, row.output_name) for row in map(stage_row, names) if not row.in_bundle]


def stage_tasks(stage: str):
    """One doit subtask of ``stage`` per selected recipe: ``file_dep`` on the records of
    the stages it reads (early cutoff), ``task_dep`` on the one before it (order), its own
    record a target when a later stage reads it."""
    row = stage_row(stage)
    previous = STAGES[STAGES.index(stage) - 1] if stage != STAGES[0] else None
    for path in selected_recipes():
        rid = _rid(path)
        task = {
            "name": rid,
            "doc": row.doc,
            "actions": [(run_stage_action, [stage, path])],
            "uptodate": [(stage_uptodate, [stage, path])],
            "file_dep": _workspace_outputs(path, row.reads),
            "task_dep": [f"{previous}:{rid}"] if previous else [],
            "targets": _workspace_outputs(path, [stage]) if is_read_by_a_later_stage(stage) else [],
        }
        if stage == STAGES[0]:  # the first stage's clean removes the whole workspace
            task["clean"] = [(clean_action, [path, "workspace"])]
        if row.in_bundle:  # the stage that writes the installed bundle removes it
            task["clean"] = [(clean_action, [path, "bundle"])]
        yield task


def generate_tasks():
    """build every stale stage of the recipe(s) through the torchrun preflight"""
    for path in selected_recipes():
        yield {"name": _rid(path), "doc": "build the bundle through the torchrun preflight",
               "actions": None, "task_dep": [f"{STAGES[-1]}:{_rid(path)}"]}


def check_tasks():
    """the committed bundle is what generate writes now (else its diff); verify it; torchrun preflight"""
    for path in selected_recipes():
        yield {"name": _rid(path), "doc": "bundle is current (else the diff of each stale file); verify; torchrun preflight",
               "actions": [(check_action, [path])], "uptodate": [False], "verbosity": 2}


def task_creators() -> dict[str, Callable[[], Iterator[dict]]]:
    """dodo.py's ``task_*`` functions: one per row of the stage table, in its order, each
    documented by the row's ``doc`` (what ``doit list`` shows), then generate and check."""
    creators = {f"task_{row.name}": _stage_creator(row.name, row.doc) for row in STAGE_TABLE}
    creators.update(task_generate=generate_tasks, task_check=check_tasks)
    return creators


def _stage_creator(stage: str, doc: str) -> Callable[[], Iterator[dict]]:
    """A doit task creator for one stage (doit takes a creator's docstring as the task's doc)."""
    def creator():
        yield from stage_tasks(stage)

    creator.__name__ = creator.__qualname__ = f"task_{stage}"
    creator.__doc__ = doc
    return creator
