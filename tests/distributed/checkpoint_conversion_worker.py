"""torchrun worker (world 2): a ``save_pretrained`` Mixtral checkpoint (per-expert
``block_sparse_moe.experts.E.w1/w2/w3``) loaded through the gen path — the generated
modeling file's class on the meta device, its ``hyper_parallelize``, then
``materialize_and_load`` — once per emitted layout, in one launch.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.distributed.checkpoint_conversion_worker \
        --model-dir DIR --out OUT_DIR --case tp2=GEN_TP2.py --case dp2_ep2=GEN_EP2.py

Every safetensors read is recorded (``safe_open`` wrapped): which tensors' data a rank
read and how many bytes. Writes ``OUT_DIR/rank<N>.json``: per case, the parameters whose
local piece differs from the same piece of ``from_pretrained``'s parameter, the bytes
read against the bytes kept, the experts read and the experts held.
"""

import argparse
import importlib.util
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import accelerate
import torch
import torch.distributed as dist
import transformers
from safetensors import safe_open
from torch.distributed.tensor import DTensor, distribute_tensor

import hyper_parallel.distributed.sharded_load as sharded_load
from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.mesh import MeshContext, ParallelDims, build_device_mesh
from tests.rank_exit import leave_after_barrier

LAYOUTS = {"tp2": ParallelDims(tp=2), "dp2_ep2": ParallelDims(dp=2, ep=2)}
_EXPERT_KEY = re.compile(r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


class _RecordingSlice:
    """A safetensors slice that logs the bytes each read returns."""

    def __init__(self, piece, name: str, log: dict[str, int]):
        self.piece, self.name, self.log = piece, name, log

    def get_shape(self):
        return self.piece.get_shape()

    def __getitem__(self, index):
        tensor = self.piece[index]
        self.log[self.name] += tensor.nbytes
        return tensor


class _RecordingHandle:
    """``safe_open`` as the loader uses it, with every slice recorded."""

    def __init__(self, log: dict[str, int], *args, **kwargs):
        self.handle, self.log = safe_open(*args, **kwargs), log

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def keys(self):
        return self.handle.keys()

    def get_slice(self, name: str):
        return _RecordingSlice(self.handle.get_slice(name), name, self.log)


def _import_generated(path: Path):
    """The emitted modeling file as its own module (as the bundle loader does, outside
    ``transformers.``: transformers calls its classes custom code)."""
    name = f"_hyper_test_generated_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _expected_local(param: DTensor, full: torch.Tensor) -> torch.Tensor:
    """torch's own local piece of ``full`` under the parameter's mesh and placements."""
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()


def _mismatches(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> list[str]:
    """Parameters whose local piece is not exactly the reference's same piece."""
    out = []
    for name, param in model.named_parameters():
        local, expected = param, reference[name]
        if isinstance(param, DTensor):
            local, expected = param.to_local(), _expected_local(param, expected)
        if local.shape != expected.shape or not torch.equal(local, expected):
            out.append(name)
    return out


def _held_experts(model: torch.nn.Module) -> list[int]:
    """The expert indices this rank holds (its chunk of the experts along the ep axis)."""
    param = model.model.layers[0].mlp.experts.gate_up_proj
    count = param.shape[0]
    mesh = param.device_mesh
    if "ep" not in (mesh.mesh_dim_names or ()):
        return list(range(count))
    return torch.arange(count).chunk(mesh.size(mesh.mesh_dim_names.index("ep")))[mesh.get_local_rank("ep")].tolist()


def run_case(module, config, model_dir: str, mesh_context: MeshContext, reference: dict[str, torch.Tensor],
             log: dict[str, int]) -> dict:
    """The gen path's build (``build_generated_model_sharded``) and what it read."""
    log.clear()
    with accelerate.init_empty_weights(include_buffers=False):
        model = module.MixtralForCausalLM(config)
    module.hyper_parallelize(model, mesh_context)
    report = sharded_load.materialize_and_load(model, model_dir)
    experts_read = sorted({(int(m[1]), int(m[2]), m[3]) for key in log if (m := _EXPERT_KEY.search(key))})
    return {"mismatches": _mismatches(model, reference), "missing": report.missing, "notes": report.notes,
            "bytes_read": sum(log.values()),
            "local_bytes": sum(p.to_local().nbytes if isinstance(p, DTensor) else p.nbytes for p in model.parameters()),
            "full_bytes": sum(t.nbytes for t in reference.values()),
            "experts_read": experts_read, "held_experts": _held_experts(model),
            "layers": config.num_hidden_layers, "class_module": type(model).__module__}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", action="append", required=True, help="LAYOUT=GENERATED_FILE")
    args = parser.parse_args()
    log: dict[str, int] = defaultdict(int)
    sharded_load.safe_open = lambda *a, **k: _RecordingHandle(log, *a, **k)
    config = transformers.AutoConfig.from_pretrained(args.model_dir)
    reference = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    reference_state = {name: p.detach() for name, p in reference.named_parameters()}
    results = {}
    for case in args.case:
        layout, _, path = case.partition("=")
        dims = LAYOUTS[layout]
        results[layout] = run_case(_import_generated(Path(path)), config, args.model_dir,
                                   MeshContext(build_device_mesh(dims, "cpu"), Layout(dims)), reference_state, log)
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    leave_after_barrier(dist)


if __name__ == "__main__":
    main()
