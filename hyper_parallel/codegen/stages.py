"""The pipeline stages' runners, and when each stage is current.

Each stage reads its inputs from the recipe's workspace (``workspace.py``), writes its
output there (and the signature it was built from into the workspace's
``signatures.json``), and is current when that recorded signature equals the one
computed now (the stage table's ``current`` rule says how each is judged). doit, the CLI
and the training path's door (``runtime/build.py``) all call these functions.
Only ``derive`` and ``preflight`` import torch, and only when they actually run.
Progress goes to this module's logger, each line tagged with its stage (``[derive] ...``);
the entry point that runs a stage decides how it is shown (``console_log``).
"""

import gc
import importlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hyper_parallel.codegen.bundle_folder import check_not_anothers_tracked_bundle, write_bundle_atomic
from hyper_parallel.codegen.hash import sha256_bytes, sha256_file, sha256_json
from hyper_parallel.codegen.replaced_bundle import drop_replaced_bundle, keep_replaced_bundle, restore_replaced_bundle
from hyper_parallel.codegen.spec.project import signature_from_spec, stage_signature
from hyper_parallel.codegen.spec.types import CodegenSpec
from hyper_parallel.codegen.stage_table import INSTALLED, SIGNATURES_FILE, STAGES, stage_row
from hyper_parallel.codegen.workspace import (
    StageFiles,
    read_stage_record,
    read_upstream,
    recorded_signatures,
    write_if_changed,
    write_json,
    write_stage_record,
)
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.runtime.meta import META_FILE

_LOG = logging.getLogger(__name__)


class StageError(RuntimeError, HyperParallelError):
    """A stage's inputs are not what the stages before it recorded (a staged file edited,
    verify run for other bytes or another layout); names the file and the command to rerun."""


def expected_signature(spec: CodegenSpec, stage: str) -> str | None:
    """The signature ``stage`` would record now, or None when an input is missing."""
    if stage_row(stage).current == INSTALLED:  # the installed bundle's meta is sealed with it
        return signature_from_spec(spec)
    upstream = {}
    for path in StageFiles(spec).upstream(stage):
        if not path.is_file():
            return None
        upstream[path.name] = sha256_file(path)
    return stage_signature(spec, stage, upstream)


def stage_is_current(spec: CodegenSpec, stage: str) -> bool:
    expected = expected_signature(spec, stage)
    if expected is None:
        return False
    if stage_row(stage).current == INSTALLED:
        return install_is_current(spec)
    record = read_stage_record(StageFiles(spec).output(stage))
    if record is None or recorded_signatures(spec).get(stage) != expected:
        return False
    outputs = record.get("outputs", {})
    staged = StageFiles(spec).staged
    return all((staged / n).is_file() and sha256_file(staged / n) == h for n, h in outputs.items())


# --- the stages ----------------------------------------------------------------------------

def run_resolve(spec: CodegenSpec) -> None:
    architectures = spec.model_config.get("architectures") or [None]
    write_stage_output(spec, "resolve", {
        "source": spec.source.identity(),
        "model_config_sha256": spec.model_config_sha256,
        "architecture": architectures[0],
    })
    where = f"remote code {spec.source.display_path(spec.model_dir_rel)}" if spec.source.is_remote \
        else spec.source.module
    siblings = "".join(f", sibling {name} {sha[:12]}" for name, sha in spec.source.siblings)
    _LOG.info(f"[resolve] source {where} sha256 {spec.source.sha256[:12]}{siblings} "
              f"(transformers {spec.source.transformers_version})")


def run_derive(spec: CodegenSpec) -> None:
    from hyper_parallel.codegen.plan.derive import derive_plan
    from hyper_parallel.distributed.plan_format import unapplied_axis_warnings

    derived = derive_plan(spec)
    plan = derived["plan"]
    write_stage_output(spec, "derive", derived)
    layout = " ".join(f"{key}={value}" for key, value in plan["layout"].items())
    _LOG.info(f"[derive] {len(plan['modules'])} module entries for the layout {layout}; "
              f"applied axes {plan['applied_axes'] or 'none'}")
    for line in unapplied_axis_warnings(plan.get("recorded_axes", {})):
        _LOG.warning(f"[derive] {line}")
    for note in derived.get("notes", ()):
        _LOG.info(f"[derive] note: {note}")
    if derived.get("dataflow_error"):
        _LOG.info(f"[derive] note: planned by module names and the TP plan's hints alone, without the dataflow "
                  f"({derived['dataflow_error']}); verify checks the result")


def run_freeze(spec: CodegenSpec) -> None:
    from hyper_parallel.codegen.plan.freeze import freeze_plan

    derived = read_upstream(StageFiles(spec).output("derive"))
    frozen = freeze_plan(derived["plan"], derived["module_names"])
    write_stage_output(spec, "freeze", {"model_class": derived["model_class"], "frozen": frozen,
                                        "weight_map": derived["weight_map"]})
    _LOG.info(f"[freeze] {len(frozen['modules'])} frozen entries (from {len(derived['plan']['modules'])})")


def run_emit(spec: CodegenSpec) -> None:
    from hyper_parallel.codegen.emit.bundle import render_bundle_init
    from hyper_parallel.codegen.emit.imports import RemoteCode
    from hyper_parallel.codegen.emit.modeling import emit_modeling_source
    from hyper_parallel.codegen.source.resolver import sibling_files, source_text

    files = StageFiles(spec)
    frozen = read_upstream(files.output("freeze"))
    source = spec.source
    remote = RemoteCode(source.model_type, source.sibling_modules) if source.is_remote else None
    text = emit_modeling_source(
        source_text=source_text(source, spec.model_dir), source_module=source.module,
        banner=banner_fields(spec, frozen["frozen"]), frozen_plan=frozen["frozen"],
        overrides=spec.plan_overrides, remote=remote)
    outputs = {spec.modeling_file: text.encode(), "__init__.py":
               render_bundle_init(spec, frozen["model_class"]).encode()}
    # Remote code: the generated file imports its siblings relatively, so the bundle
    # (a package) carries byte-identical copies of them.
    outputs.update(sibling_files(source, spec.model_dir))
    _write_staged(spec, "emit", outputs)
    siblings = f" + {len(source.siblings)} sibling(s)" if source.siblings else ""
    _LOG.info(f"[emit] {spec.modeling_file}: {len(text.splitlines())} lines{siblings}")


def run_diff(spec: CodegenSpec) -> None:
    from hyper_parallel.codegen.emit.diff import unified_diff_text
    from hyper_parallel.codegen.source.resolver import source_text

    generated = (StageFiles(spec).staged / spec.modeling_file).read_text(encoding="utf-8")
    diff = unified_diff_text(source_text(spec.source, spec.model_dir), spec.source.display_path(spec.model_dir_rel),
                             generated, spec.modeling_file)
    _write_staged(spec, "diff", {spec.diff_file: diff.encode()})
    _LOG.info(f"[diff] {spec.diff_file}: {sum(1 for line in diff.splitlines() if line[:1] in '+-')} changed lines")


def run_verify(spec: CodegenSpec) -> None:
    from hyper_parallel.codegen.check.verify import verify_bundle

    files = StageFiles(spec)
    emitted = read_upstream(files.output("emit"))["outputs"]
    staged_bytes(spec, emitted, "verify")
    model_class = read_upstream(files.output("freeze"))["model_class"]
    report = verify_bundle(spec, files.staged, sha256_json(emitted)[:12], emitted, model_class)
    write_stage_output(spec, "verify", {"outputs": emitted, "report": report})


def staged_bytes(spec: CodegenSpec, expected: dict[str, str], stage: str) -> dict[str, bytes]:
    """The staged files, each read once, which must be the bytes the earlier stage
    recorded (``expected``: name -> sha256): an edited staged file is refused."""
    staged = StageFiles(spec).staged
    payload = {}
    for name, sha in expected.items():
        path = staged / name
        data = path.read_bytes() if path.is_file() else None
        actual = "missing" if data is None else sha256_bytes(data)
        if actual != sha:
            raise StageError(f"{path}: changed since it was staged (sha256 {actual}, staged {sha}); {stage} "
                               f"refuses it: run `doit generate config={spec.recipe_path}` to rebuild it")
        payload[name] = data
    return payload


def expected_bundle(spec: CodegenSpec) -> dict[str, bytes]:
    """Every file generate would install now, ``codegen_meta.json`` included, after
    bringing the stages through diff up to date (none runs when the workspace is current)."""
    for stage in STAGES[:STAGES.index("diff") + 1]:
        if not stage_is_current(spec, stage):
            run_stage(spec, stage)
    payload, meta = install_payload(spec, expected_verified(spec))
    return {**payload, META_FILE: meta}


def install_payload(spec: CodegenSpec, verified: dict[str, Any]) -> tuple[dict[str, bytes], bytes]:
    """The staged files (checked against the hashes emit and diff recorded) and the meta
    install writes beside them: the one definition of an installed bundle's bytes."""
    from hyper_parallel.codegen.meta import build_codegen_meta

    files = StageFiles(spec)
    emitted = read_upstream(files.output("emit"))["outputs"]
    payload = staged_bytes(spec, {**emitted, **read_upstream(files.output("diff"))["outputs"]}, "install")
    frozen = read_upstream(files.output("freeze"))
    meta = build_codegen_meta(spec, signature=signature_from_spec(spec), files=payload,
                              frozen=frozen["frozen"], model_class=frozen["model_class"], verified=verified,
                              weight_map=frozen["weight_map"])
    return payload, meta


def verify_installed(spec: CodegenSpec) -> dict[str, Any]:
    """``doit check``: run verify on the installed bundle (what training will import)."""
    from hyper_parallel.codegen.check.verify import verify_bundle
    from hyper_parallel.runtime.meta import load_codegen_meta

    meta = load_codegen_meta(spec.bundle_dir)
    return verify_bundle(spec, spec.bundle_dir, meta["signature"], meta["outputs"],
                         meta["model"]["model_class"])


def check_installed(spec: CodegenSpec) -> None:
    """What ``check`` runs on a bundle the freshness gate passed: verify on the installed
    files, then preflight."""
    verify_installed(spec)
    run_stage(spec, "preflight")


def expected_verified(spec: CodegenSpec) -> dict[str, Any]:
    """What codegen_meta.json says about the verify run: how it runs for this layout, not
    its timings or measured errors (the meta is committed; its bytes must not move with
    float noise from one machine to another). The figures are in the workspace's verify.json."""
    from hyper_parallel.codegen.check.verify_mode import verified_record

    return verified_record(spec.layout.world_size)


def run_install(spec: CodegenSpec) -> None:
    files = StageFiles(spec)
    emit_record, verify_record = files.output("emit"), files.output("verify")
    verified = read_upstream(verify_record)
    if verified.get("outputs") != read_upstream(emit_record)["outputs"]:
        raise StageError(f"{verify_record}: verified other staged bytes than {emit_record} lists; "
                           f"run `doit generate config={spec.recipe_path}`")
    expected = expected_verified(spec)
    if {key: verified["report"].get(key) for key in expected} != expected:
        raise StageError(f"{verify_record}: verify ran as {verified['report']}, this layout needs {expected}; "
                           f"run `doit generate config={spec.recipe_path}`")
    check_not_anothers_tracked_bundle(spec.bundle_dir, spec.recipe_rel, f"doit generate config={spec.recipe_path}")
    payload, meta = install_payload(spec, expected)
    replaced = installed_recipe(spec.bundle_dir)
    if replaced is not None and replaced != spec.recipe_rel:
        _LOG.warning(f"[install] warning: {spec.bundle_dir} held the bundle of {replaced}; "
                     f"it now holds {spec.recipe_rel}'s. Recipes that share a folder share one bundle: give each its own model.codegen_artifact_dir")
    keep_replaced_bundle(spec, meta)  # put back if preflight fails on what is installed now
    write_bundle_atomic(spec.bundle_dir, payload, meta)
    _LOG.info(f"[install] installed {spec.bundle_dir}")


def installed_recipe(bundle_dir: Path) -> str | None:
    """The recipe (relative to the bundle) the installed bundle was built from, if readable."""
    from hyper_parallel.runtime.meta import MetaError, load_codegen_meta

    try:
        return load_codegen_meta(bundle_dir).get("recipe")
    except MetaError:
        return None


def run_preflight(spec: CodegenSpec) -> None:
    """Preflight the installed bundle; where it fails on the bundle install just put in,
    the one install replaced goes back (``replaced_bundle``): a failed generate leaves no
    bundle the next start would import."""
    from hyper_parallel.codegen.check.preflight import run_torchrun_preflight
    from hyper_parallel.runtime.integrity import PreflightError

    try:
        report = run_torchrun_preflight(spec)
    except Exception as exc:
        done = restore_replaced_bundle(spec)
        if done is None:
            raise
        reason, fix, _ = str(exc).partition("\n  fix:")  # what was done before the fix line
        raise PreflightError(f"{reason}\n  {done}" + (f"\n  fix:{fix}" if fix else "")) from exc
    drop_replaced_bundle(spec)
    write_stage_output(spec, "preflight", {"report": report})


def stage_runner(stage: str) -> Callable[[CodegenSpec], None]:
    """The function the stage table names as the stage's runner."""
    module, _, function = stage_row(stage).runner.partition(":")
    return getattr(importlib.import_module(module), function)


def run_stage(spec: CodegenSpec, stage: str) -> float:
    """Run one stage (unconditionally) and return its wall time in seconds."""
    start = time.perf_counter()
    stage_runner(stage)(spec)
    return time.perf_counter() - start


def keep_until_exit() -> None:
    """For the build tool's own process (doit, ``python -m hyper_parallel.codegen``),
    which is short-lived: what its stages leave behind (torch, transformers, the meta
    model) lives until it exits. Frozen (``gc.freeze``), those millions of objects are
    no longer walked by each later collection, nor by the last one at exit (about a
    second of a 235B-class recipe's generate). Once a heap is frozen, what a later stage
    left is collected first (walking only what is not frozen), so no cycle of its garbage
    (a verify run's tensors) is kept to the end. Not for a trainer generating in-process."""
    if gc.get_freeze_count():
        gc.collect()
    gc.freeze()


def banner_fields(spec: CodegenSpec, frozen: dict[str, Any]) -> dict[str, Any]:
    return {
        "recipe": spec.recipe_rel,
        "source_module": spec.source.module,
        "transformers_version": spec.source.transformers_version,
        "parallel_dims": spec.parallel_record(),
        "applied_axes": frozen["applied_axes"],
        "recorded_axes": frozen["recorded_axes"],
    }




def write_stage_output(spec: CodegenSpec, stage: str, record: dict[str, Any]) -> None:
    """Stage ``stage``'s record, then the signature it was built from. The signature lives
    apart (``signatures.json``) so that the record's bytes are its content alone: a rerun
    that produces the same content (a codegen change that emits the same code) leaves the
    record untouched, and no later stage reruns (early cutoff on content)."""
    write_stage_record(StageFiles(spec).output(stage), record)
    signatures = recorded_signatures(spec)
    signatures[stage] = expected_signature(spec, stage)
    write_json(spec.workspace / SIGNATURES_FILE, dict(sorted(signatures.items())))


def install_is_current(spec: CodegenSpec) -> bool:
    """The installed bundle is, byte for byte and file for file, what install would write
    from the verified staged bundle now (judged on bytes, whatever the meta claims)."""
    files = StageFiles(spec)
    verified, emitted = read_stage_record(files.output("verify")), read_stage_record(files.output("emit"))
    if verified is None or emitted is None or verified.get("outputs") != emitted.get("outputs"):
        return False
    try:
        payload, meta = install_payload(spec, expected_verified(spec))
    except (OSError, RuntimeError):
        return False
    expected = {**payload, META_FILE: meta}
    folder = spec.bundle_dir
    present = {p.name for p in folder.iterdir() if p.is_file()} if folder.is_dir() else set()
    return present == set(expected) and all((folder / name).read_bytes() == data for name, data in expected.items())


def _write_staged(spec: CodegenSpec, stage: str, outputs: dict[str, bytes]) -> None:
    files = StageFiles(spec)
    for name, data in outputs.items():
        write_if_changed(files.staged / name, data)
    write_stage_output(spec, stage, {"outputs": {name: sha256_bytes(data) for name, data in outputs.items()}})


