"""torchrun worker for test_gather_layout: a weight split over tp (plainly, or packed as
[gate | up] blocks) and then fully_shard over dp, as the trainer and verify lay out a fused
gate/up projection; each rank writes which whole-tensor rows it holds, as data (each row
holds its own number) and as ``gathered_grads.local_elements`` computes them."""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.codegen.check.gathered_grads import local_elements
from hyper_parallel.distributed.applier import local_piece

ROWS = 16


class Holder(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = nn.Parameter(weight)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rows = torch.arange(ROWS, dtype=torch.float32).reshape(ROWS, 1).repeat(1, 2)
    results = {}
    for name, placement in (("plain", Shard(0)), ("packed", _StridedShard(0, split_factor=2))):
        local = local_piece(rows, placement, 2, mesh["tp"].get_local_rank())
        holder = Holder(DTensor.from_local(local, mesh["tp"], (placement,), run_check=False))
        fully_shard(holder, mesh=mesh["dp"])
        weight = holder.weight
        index = local_elements(torch.arange(ROWS), weight.placements, [2, 2], mesh.get_coordinate())
        results[name] = {"held": weight.to_local()[:, 0].long().tolist(), "computed": index.tolist(),
                         "placements": str(weight.placements)}
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
