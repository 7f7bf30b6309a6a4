"""Under torchrun (gloo): ``exchange``'s collectives against what they stand for, on
every rank, and what they sent freed once waited for; each rank writes its findings to
``rank<N>.json`` in the folder given as the first argument (files, not stdout, where
the ranks' lines could interleave)."""

import gc
import json
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from hyper_parallel.distributed import exchange


def _sent_refs():
    """Weak references to every tensor handed to all_to_all_single as its input."""
    sent, original = [], dist.all_to_all_single

    def recording(output, inp, *args, **kwargs):
        sent.append(weakref.ref(inp))
        return original(output, inp, *args, **kwargs)

    dist.all_to_all_single = recording
    return sent


def main() -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    sent = _sent_refs()
    of_rank = [torch.randn(2, 3, 4 * size, 5, generator=torch.Generator().manual_seed(peer)) for peer in range(size)]
    mine = of_rank[rank].clone()
    pieces = exchange.all_gather_async(mine, group)()
    gathered = all(torch.equal(piece, of_rank[peer]) for peer, piece in enumerate(pieces))
    piece = exchange.reduce_scatter_async(mine, group, 2)()
    scattered = torch.allclose(piece, sum(of_rank).chunk(size, dim=2)[rank], atol=1e-6)
    flat = mine.reshape(-1).clone()
    exchange.all_reduce_sum(flat, group)
    reduced = torch.allclose(flat, sum(of_rank).reshape(-1), atol=1e-6)
    # uneven rows: rank r sends peer p (r + p) % 3 rows (none to some), rows made of (r, p)
    count = lambda source, peer: (source + peer) % 3  # noqa: E731
    rows_for = [torch.full((count(rank, peer), 2, 3), float(rank * 10 + peer)) for peer in range(size)]
    by_peer = exchange.exchange_rows_async(rows_for, [count(peer, rank) for peer in range(size)], group)()
    exchanged = by_peer[rank] is None and all(
        torch.equal(rows, torch.full((count(peer, rank), 2, 3), float(peer * 10 + rank)))
        for peer, rows in enumerate(by_peer) if peer != rank)
    del pieces, piece, by_peer, rows_for
    # gloo's worker thread lets go of a finished exchange just after the wait returns
    for _ in range(50):
        gc.collect()
        if all(ref() is None for ref in sent):
            break
        time.sleep(0.02)
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "gathered": gathered, "scattered": scattered, "reduced": reduced, "exchanged": exchanged,
         "exchanges": len(sent), "sent_freed": all(ref() is None for ref in sent)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
