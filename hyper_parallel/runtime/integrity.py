"""The checks every rank runs on an installed bundle before it trains with one.

Each says what is wrong and ends with the fix (the command that regenerates the bundle,
which the build tool's door, ``runtime/build.py``, words): the meta reads and lists the
expected signature; every listed file is present with its sha256; remote-code siblings
are carried unchanged; the plan is not empty and covers every trainable parameter; and
every rank imports the same bytes (``integrity_across_ranks``). Torch-free at import.
"""

from pathlib import Path
from typing import Any

from hyper_parallel.digest import sha256_bytes, sha256_file
from hyper_parallel.distributed.ranks import group_of_several_ranks, node_of_this_rank
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.runtime.meta import META_FILE, MetaError, load_codegen_meta


class PreflightError(RuntimeError, HyperParallelError):
    """The bundle is not fit to train with; the message says what and how to fix it."""


def preflight_integrity_check(bundle_dir: str | Path, *, expected_signature: str | None = None,
                              model: Any = None, fix: str = "doit generate") -> dict[str, Any]:
    """Checks every rank runs before importing a bundle. Returns a small report."""
    from hyper_parallel.runtime.loader import load_generated_module

    bundle_dir = Path(bundle_dir)
    try:
        meta = load_codegen_meta(bundle_dir)
    except MetaError as exc:
        raise PreflightError(f"{exc}\n  fix: {fix}") from None
    if expected_signature is not None and meta["signature"] != expected_signature:
        raise PreflightError(f"{bundle_dir / META_FILE}: signature mismatch: expected {expected_signature}, "
                             f"bundle has {meta['signature']}\n  fix: {fix}")
    problems = bundle_file_problems(bundle_dir, meta)
    if problems:
        raise PreflightError("\n".join(problems) + f"\n  fix: {fix}")
    module = load_generated_module(bundle_dir)
    plan = getattr(module, "HYPER_PARALLEL_PLAN", None)
    if not plan or not plan.get("modules"):
        raise PreflightError(f"{bundle_dir / meta['modeling_file']}: HYPER_PARALLEL_PLAN is empty\n  fix: {fix}")
    if model is not None:
        check_plan_covers(model, module, bundle_dir / meta["modeling_file"], fix)
    return {"signature": meta["signature"], "digest": bundle_digest(bundle_dir, meta),
            "plan_entries": len(plan["modules"])}


def bundle_digest(bundle_dir: Path, meta: dict[str, Any]) -> str:
    """One hash for everything a rank will import: the meta and every listed file."""
    parts = [sha256_file(bundle_dir / META_FILE)] + [
        f"{name}={sha256_file(bundle_dir / name)}" for name in sorted(meta["outputs"])]
    return sha256_bytes("\n".join(parts).encode())


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


def uncovered_parameters(model: Any, modules: dict[str, dict]) -> list[str]:
    """Trainable parameters no entry of ``modules`` (full entries, ``plan_entries``) places,
    read as the applier reads them (``name_match.placed_parameters``: an entry may place a
    child's parameter by its dotted name)."""
    from hyper_parallel.distributed.name_match import placed_parameters

    placed = placed_parameters([name for name, _ in model.named_modules()], modules)
    return [name for name, param in model.named_parameters() if param.requires_grad and name not in placed]


def check_plan_covers(model: Any, module: Any, where: Path, fix: str) -> None:
    """The model a run built (replacements applied) has no trainable parameter the
    bundle's frozen plan leaves unplaced, and none that two of its entries place."""
    from hyper_parallel.distributed.name_match import PlanEntryConflict
    from hyper_parallel.distributed.plan_format import plan_entries

    try:
        uncovered = uncovered_parameters(model, plan_entries(module.HYPER_PARALLEL_PLAN))
    except PlanEntryConflict as exc:
        raise PreflightError(f"{where}: the frozen plan: {exc}\n  fix: {fix}") from None
    if uncovered:
        raise PreflightError(f"{where}: the frozen plan covers no entry for parameter(s) "
                             f"{', '.join(uncovered[:5])}\n  fix: {fix}")


def integrity_across_ranks(bundle_dir: Path, *, expected_signature: str, fix: str) -> dict[str, Any]:
    """``preflight_integrity_check`` on this rank, then, with a process group of several
    ranks, every rank's verdict and digest gathered: a rank whose copy fails its check (an
    edited file on a node-local disk) or differs from rank 0's fails every rank's start
    alike, named with its node (no rank is left waiting in a collective the failed one
    never joins). Returns this rank's report."""
    import torch.distributed as dist

    several = group_of_several_ranks()
    try:
        report, error = preflight_integrity_check(bundle_dir, expected_signature=expected_signature, fix=fix), ""
    except PreflightError as exc:
        if not several:
            raise
        report, error = {}, str(exc)
    if not several:
        return report
    entries: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(entries, {"digest": report.get("digest"), "error": error, "node": node_of_this_rank()})
    failed = [rank for rank, entry in enumerate(entries) if entry["error"]]
    if failed:
        raise PreflightError(f"{bundle_dir}: the bundle fails its integrity check on rank(s) {failed} "
                             f"({_nodes(entries, failed)}): {entries[failed[0]]['error']}")
    differing = [rank for rank, entry in enumerate(entries) if entry["digest"] != entries[0]["digest"]]
    if differing:
        raise PreflightError(f"{bundle_dir}: bundle digest differs across ranks: rank 0 ({entries[0]['node']}) has "
                             f"{entries[0]['digest'][:12]}, rank(s) {differing} ({_nodes(entries, differing)}) have "
                             f"{[entries[r]['digest'][:12] for r in differing]}\n  fix: {fix} and make the folder "
                             f"the same on every node")
    return report


def _nodes(entries: list[dict], ranks: list[int]) -> str:
    return ", ".join(dict.fromkeys(entries[rank]["node"] for rank in ranks))
