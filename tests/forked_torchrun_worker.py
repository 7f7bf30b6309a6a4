"""What tests/test_forked_torchrun.py runs on each rank: join gloo, sum the ranks over
an all-reduce, and write what the rank was handed to ``OUT/rank<N>.json``."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(out: str) -> None:
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    report = {"MASTER_ADDR": os.environ.get("MASTER_ADDR"), "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME"),
              "sum": total.item(), "world": dist.get_world_size()}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
