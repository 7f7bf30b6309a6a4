"""One run device (issue 52, item 3): a check that fails on CPU for what breaks on a GPU or
an NPU.

On CPU every tensor lands on the run's device whether or not the code asked for it, so
no CPU run can show a tensor made on the wrong device. The run path's source can: in
``trainer/``, ``distributed/``, ``runtime/``, ``models/`` and ``components/``, every torch
factory call names its ``device=`` (a tensor a step makes without one lands on the CPU,
where nccl and hccl have no backend and where every use copies it to the device), no code
moves a tensor to the host (``.cpu()``, ``.item()``, ``.tolist()``, ``.numpy()``: each a
device sync) and nothing is made in float64 (hccl reduces none), except where
``ALLOWED`` says why: host-side objects (data read from files, the batch's random
numbers, mesh ranks), build-time planning that runs on the CPU before any run, module
construction that the builder places, and the one read of each reported figure.

The check is by site (file, function, kind of call): a new site, or a new kind of call in
an allowed function, fails with the file, line and the fix. On the code before issue 52
it failed on the gradient norm, the eval and pipeline loss sums and the memory peaks."""

import ast
from pathlib import Path

import hyper_parallel

PACKAGE = Path(hyper_parallel.__file__).parent
RUN_PATH = ("trainer", "distributed", "runtime", "models", "components")
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint", "randperm",
             "as_tensor", "linspace", "eye"}
HOST_TRANSFERS = {"cpu", "item", "tolist", "numpy"}
# platform/host_values.py: the reads above through the one door that fake tensors pass (a read all the same)
HOST_READS = {"to_host_list", "to_host_float", "counts_to_host"}

_HOST_DATA = "host-side data: read from files or drawn by a seeded CPU generator, moved to the run device by its user"
_PLANNING = "build-time planning (dry runs over a meta or CPU model before any run), never a training step"
_CONSTRUCTION = "module construction: the builder makes parameters on the meta device or moves the model to the run device"
_REPORTED = "the one read of a reported figure per step (loss, gradient norm, eval loss, memory peaks)"
_REFERENCE = "single-process HF reference training, on the CPU by design (tests and benches compare with it)"

# (file relative to the package, function, rule) -> why the site may do it
ALLOWED: dict[tuple[str, str, str], str] = {
    ("trainer/base.py", "BaseTrainer.train", "host:to_host_float"): _REPORTED,
    ("trainer/base.py", "BaseTrainer._eval_loss", "host:item"): _REPORTED,
    ("trainer/evaluation.py", "eval_loss", "host:item"): _REPORTED,
    ("trainer/observe.py", "StepObserver._gather_peaks", "host:to_host_list"): _REPORTED,
    ("distributed/grad_norm.py", "global_grad_norm", "host:to_host_float"): _REPORTED,
    ("trainer/corpus.py", "row_indices", "factory:arange"): _HOST_DATA,
    ("trainer/corpus.py", "row_indices", "factory:empty"): _HOST_DATA,
    ("trainer/corpus.py", "row_indices", "factory:randperm"): _HOST_DATA,
    ("trainer/corpus.py", "row_indices", "host:tolist"): _HOST_DATA,
    ("trainer/data.py", "global_batch", "factory:randint"): _HOST_DATA,
    ("trainer/data.py", "read_byte_tokens", "factory:tensor"): _HOST_DATA,
    ("trainer/evaluation.py", "hold_out", "factory:zeros"): _HOST_DATA,
    ("trainer/evaluation.py", "hold_out", "factory:randperm"): _HOST_DATA,
    ("trainer/export.py", "_Reader._read", "factory:empty"): "export reads a checkpoint's tensors into host memory to write them",
    ("trainer/safetensors_stream.py", "", "float64"): "a dtype table for safetensors headers, not a tensor",
    ("trainer/safetensors_stream.py", "StreamedSafetensors.add", "host:numpy"): "writing a tensor's bytes to a file",
    ("trainer/token_cache.py", "load_entry", "factory:empty"): _HOST_DATA,
    ("trainer/reference.py", "add_rounding_noise", "factory:randn"): _REFERENCE,
    ("trainer/reference.py", "reference_training", "host:item"): _REFERENCE,
    ("distributed/state_handoff.py", "", "float64"): "a dtype table for the cp hand-off header (states keep their "
                                                       "model's dtype), not a tensor",
    ("distributed/state_handoff.py", "Link.send_states", "factory:zeros"): "the hand-off header is filled on the "
                                                                              "host, then sent from the run device",
    ("distributed/state_handoff.py", "Link.send_states", "factory:tensor"): "the hand-off header is filled on the "
                                                                               "host, then sent from the run device",
    ("distributed/state_handoff.py", "Link.receive_header", "host:tolist"): "the header's shapes size the receive "
                                                                               "buffers: one read per hand-off",
    ("distributed/expert_dispatch.py", "_dispatch_and_combine", "host:counts_to_host"): "all_to_all_single takes its split "
                                                                                "sizes as Python lists (one read per MoE layer)",
    ("components/modules/routed_experts.py", "ExpertRoutes.of", "host:counts_to_host"): "the per-expert row counts size the "
                                                                                "grouped matmuls (one read per MoE layer)",
    ("distributed/causal_blocks.py", "_kernel_takes_kv_heads", "factory:zeros"): "probes the CPU flash kernel, which "
                                                                                 "runs only on CPU tensors (usable())",
    ("distributed/context_parallel.py", "balanced_order", "factory:arange"): "made once per length and moved to the "
                                                                             "device it is used on (SequenceOrder.indices)",
    ("distributed/local_views.py", "PackedRows.stored_rows", "factory:arange"): "row indices for loading and "
                                                                                "verification, on the host",
    ("distributed/mesh.py", "build_expert_mesh", "factory:arange"): "the mesh's rank numbers (DeviceMesh takes them "
                                                                    "on the host)",
    ("distributed/pipeline.py", "check_stage_handoff", "factory:empty"): _PLANNING,
    ("distributed/weight_map_sources.py", "Assembled.read", "factory:empty"): "checkpoint bytes read on the host, copied "
                                                                    "into the rank's parameters",
    ("models/common/moe.py", "Router.__init__", "factory:zeros"): _CONSTRUCTION,
    ("models/common/moe.py", "Experts.__init__", "factory:empty"): _CONSTRUCTION,
    ("models/common/rmsnorm.py", "RMSNorm.__init__", "factory:ones"): _CONSTRUCTION,
    ("models/common/rope.py", "RoPE.__init__", "factory:empty"): _CONSTRUCTION,
    ("components/modules/grouped_experts.py", "GroupedExperts.__init__", "factory:empty"): _CONSTRUCTION,
}


def run_path_sites(package: Path = PACKAGE) -> list[tuple[str, str, str, int]]:
    """Every (file, function, rule, line) of the run path that makes a tensor without a
    device, moves one to the host or names float64."""
    sites = []
    for part in RUN_PATH:
        for path in sorted((package / part).rglob("*.py")):
            relative = path.relative_to(package).as_posix()
            sites += [(relative, *site) for site in _sites(ast.parse(path.read_text(), filename=str(path)))]
    return sites


def _sites(tree: ast.Module) -> list[tuple[str, str, int]]:
    found: list[tuple[str, str, int]] = []
    scope: list[str] = []

    class Visitor(ast.NodeVisitor):
        def visit_ClassDef(self, node):
            scope.append(node.name)
            self.generic_visit(node)
            scope.pop()

        visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef

        def visit_Call(self, node):
            func, where = node.func, ".".join(scope)
            if isinstance(func, ast.Attribute):
                if (isinstance(func.value, ast.Name) and func.value.id == "torch" and func.attr in FACTORIES
                        and not any(keyword.arg == "device" for keyword in node.keywords)):
                    found.append((where, f"factory:{func.attr}", node.lineno))
                elif func.attr in HOST_TRANSFERS and not node.args and not node.keywords:
                    found.append((where, f"host:{func.attr}", node.lineno))
                elif func.attr in HOST_READS:
                    found.append((where, f"host:{func.attr}", node.lineno))
                elif func.attr == "double" and not node.args:
                    found.append((where, "float64", node.lineno))
            elif isinstance(func, ast.Name) and func.id in HOST_READS:
                found.append((where, f"host:{func.id}", node.lineno))
            self.generic_visit(node)

        def visit_Attribute(self, node):
            if node.attr == "float64" and isinstance(node.value, ast.Name) and node.value.id == "torch":
                found.append((".".join(scope), "float64", node.lineno))
            self.generic_visit(node)

    Visitor().visit(tree)
    return found


def test_the_run_path_makes_its_tensors_on_the_run_device():
    unexplained = [f"{path}:{line} in {function or '<module>'}: {rule}"
                   for path, function, rule, line in run_path_sites() if (path, function, rule) not in ALLOWED]
    assert unexplained == [], (
        "tensors made without device=, host transfers or float64 on the run path (nccl/hccl take no CPU "
        "tensor; each host read is a device sync; hccl reduces no float64):\n  " + "\n  ".join(unexplained)
        + "\nfix: make it with device= from the run device (platform/device.py), keep the sum on the device "
          "and read it once, or, for a host-side object, add the site to ALLOWED with the reason")


def test_every_allowed_site_is_still_there():
    present = {(path, function, rule) for path, function, rule, _ in run_path_sites()}
    assert sorted(set(ALLOWED) - present) == []
