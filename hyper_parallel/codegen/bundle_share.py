"""The bundle on every node, with or without a shared filesystem: global rank 0 builds or
reuses it, then sends its bytes over the process group, and each node's local rank 0
installs them (atomically, ``bundle_folder.write_bundle_atomic``) where that node's copy
is missing or stale.

Why send the bytes rather than have each node generate: generation is deterministic,
but it runs the verify stage (a torchrun of the whole world's size on a probe) once per
node, minutes on a large world, and needs the model's source and config on every node;
the bundle is a few hundred kilobytes. Rank 0 alone builds, the others wait inside a
collective bounded by the wait timeout, and a failure of rank 0's build reaches every
rank as rank 0's own message (no failure file a node-local disk would hide).

A node whose folder is the same as rank 0's (a shared filesystem) finds the current
bundle there already and writes nothing; a node whose copy carries the current
signature keeps it even if its bytes were edited: the integrity check and the digest
all-gather that follow refuse such a copy, naming the node's ranks, rather than silently
repairing it.
"""

import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from hyper_parallel.codegen.bundle_folder import write_bundle_atomic
from hyper_parallel.codegen.workspace import read_json
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.distributed.ranks import node_of_this_rank
from hyper_parallel.runtime.meta import META_FILE


_LOG = logging.getLogger(__name__)


class BundleShareError(RuntimeError, HyperParallelError):
    """The ranks could not all get rank 0's bundle; names the ranks and what happened."""


def bundle_payload(bundle_dir: Path) -> dict[str, Any]:
    """The installed bundle's files (name -> bytes), the meta apart: what rank 0 sends."""
    files = {path.name: path.read_bytes() for path in sorted(bundle_dir.iterdir())
             if path.is_file() and path.name != META_FILE}
    return {"files": files, "meta": (bundle_dir / META_FILE).read_bytes()}


def share_bundle(spec: Any, signature: str, build: Any, *, rank: int, timeout_s: float) -> None:
    """Rank 0 runs ``build()`` (generate, or reuse the current bundle) and sends the result;
    every rank receives it; each node's local rank 0 installs it where its copy is missing
    or carries another signature. Every rank's verdict is gathered at the end, so nobody
    reads a bundle while its node writes it, and every rank raises alike when rank 0's
    build failed, a rank's recipe projects to another signature than rank 0's, or a node
    cannot write its copy."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))  # objects travel on the CPU
    sent: dict[str, Any] = {"signature": signature}
    failure: BaseException | None = None
    if rank == 0:
        try:
            build()
            sent.update(bundle_payload(spec.bundle_dir))
        except Exception as exc:  # every rank must still take part: they get the message
            failure, sent["error"] = exc, f"{type(exc).__name__}: {exc}"
    box = [sent if rank == 0 else None]
    try:
        dist.broadcast_object_list(box, src=0, group=group)
    except RuntimeError as exc:
        raise BundleShareError(f"rank {rank} ({node_of_this_rank()}): waited up to {timeout_s:.0f}s for rank 0 to "
                               f"build and send {spec.bundle_dir.name}'s bundle and did not get it: "
                               f"{' '.join(str(exc).split())[:300]}; is rank 0 alive?") from None
    received = box[0]
    if failure is not None:
        raise failure
    if "error" in received:
        raise BundleShareError(f"rank 0 failed to generate {spec.bundle_dir}: {received['error']}")
    problem = ""
    if received["signature"] != signature:
        problem = (f"rank {rank} ({node_of_this_rank()}): its recipe projects to bundle signature {signature[:12]}, "
                   f"rank 0's to {received['signature'][:12]}: the nodes hold different recipes, model folders or "
                   f"hyper_parallel versions; give every node the same checkout")
    elif rank != 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            _install_if_stale(spec.bundle_dir, received, signature)
        except (OSError, HyperParallelError) as exc:
            problem = f"rank {rank} ({node_of_this_rank()}): cannot install rank 0's bundle: {exc}"
    # every rank's verdict, so a problem on one node stops every rank (none waits on it)
    verdicts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, problem, group=group)
    dist.destroy_process_group(group)
    first = next((verdict for verdict in verdicts if verdict), "")
    if first:
        raise BundleShareError(first)


def _install_if_stale(bundle_dir: Path, received: dict[str, Any], signature: str) -> None:
    """Write rank 0's bundle here unless this folder already holds one of the same
    signature (the same folder as rank 0's, or a copy of it)."""
    meta = read_json(bundle_dir / META_FILE)
    if meta and meta.get("signature") == signature:
        return
    write_bundle_atomic(bundle_dir, received["files"], received["meta"])
    # said on every launch that writes a node's disk (other ranks log warnings only)
    _LOG.warning(f"{node_of_this_rank()}: installed rank 0's bundle at {bundle_dir} (signature {signature[:12]}; "
                 f"this node's copy was {'stale' if meta else 'missing'})")
