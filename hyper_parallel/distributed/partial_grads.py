"""Gradients that arrive ``Partial`` on a parameter placed ``Replicate`` (a replicated
weight whose work is split: q/k norms over heads, norms over the sequence), reduced
together when backward ends.

``local_with_grad_placements`` is the parameter's local value for the module's forward
(DTensor's ``to_local(grad_placements=...)`` with its specs made once). The
parameter's post-accumulate hook only records it; one callback at the end of the
backward pass sums the recorded gradients over their process groups, in flat buffers
of at most ``FLAT_BYTES`` (one collective per buffer, not one per parameter), so
``param.grad`` has the parameter's placements before ``backward()`` returns.
"""

import copy
import threading

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_global_tensor_info

from hyper_parallel.distributed.exchange import all_reduce_sum

# Per thread: each rank of a threaded (simulated) world runs its own backward.
_local = threading.local()


def _pending_params() -> list[torch.Tensor]:
    if not hasattr(_local, "pending"):
        _local.pending = []
    return _local.pending


class _LocalWithGradSpec(torch.autograd.Function):
    """``param.to_local(grad_placements=...)``: the local tensor forward; backward hands
    the gradient on as a DTensor of the given placements. DTensor's own builds that
    DTensor through ``from_local`` and a fresh spec on every backward, about 0.1 ms per
    parameter per step (measured here); this takes its spec from ``specs``, made once
    per gradient stride (a copy each time: sharding propagation may write to a spec)."""

    @staticmethod
    def forward(ctx, param: DTensor, specs: "_GradSpecs"):
        ctx.specs = specs
        ctx.set_materialize_grads(False)
        local = param._local_tensor
        return local.view_as(local)  # a fresh tensor: autograd writes its metadata here

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:
            return None, None
        spec = ctx.specs.of(grad)
        if grad.requires_grad:  # a double backward (create_graph): from_local keeps the graph
            return DTensor.from_local(grad, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                      stride=spec.stride), None
        return DTensor(grad, spec, requires_grad=False), None


class _GradSpecs:
    """The DTensor specs of one parameter's gradient placed ``placements``, by stride."""

    def __init__(self, param: DTensor, placements: tuple):
        self.spec, self.placements = param._spec, tuple(placements)
        self.by_stride: dict[tuple, DTensorSpec] = {}

    def of(self, grad: torch.Tensor) -> DTensorSpec:
        spec = self.by_stride.get(grad.stride())
        if spec is None:
            _, stride = compute_global_tensor_info(grad, self.spec.mesh, self.spec.placements)
            meta = self.spec.tensor_meta
            spec = self.by_stride[grad.stride()] = DTensorSpec(
                self.spec.mesh, self.placements, tensor_meta=TensorMeta(meta.shape, tuple(stride), meta.dtype))
        return copy.copy(spec)


def local_with_grad_placements(param: DTensor, placements: tuple, cache: dict) -> torch.Tensor:
    """``param``'s local tensor, its gradient placed ``placements`` (``Partial`` where the
    work is split); ``cache`` (the caller's, one per module) keeps the specs."""
    if torch.compiler.is_compiling():  # traced: DTensor's own, which dynamo knows (no graph break)
        return param.to_local(grad_placements=placements)
    key = (id(param), tuple(placements))
    specs = cache.get(key)
    if specs is None or specs.spec is not param._spec:
        specs = cache[key] = _GradSpecs(param, placements)
    return _LocalWithGradSpec.apply(param, specs)


def reduce_partial_grad(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a DTensor parameter."""
    grad = param.grad
    if not isinstance(grad, DTensor) or tuple(grad.placements) == tuple(param.placements):
        return
    pending = _pending_params()
    if not pending:
        torch.autograd.Variable._execution_engine.queue_callback(_reduce_pending)
    pending.append(param)


def _summed_dims(grad_placements, param_placements) -> tuple[int, ...] | None:
    """Mesh dims where a partial sum becomes the replicated parameter's gradient; ``None``
    when the gradient needs some other redistribution."""
    dims = []
    for dim, (have, want) in enumerate(zip(grad_placements, param_placements)):
        if have == want:
            continue
        if isinstance(have, Partial) and have.reduce_op == "sum" and isinstance(want, Replicate):
            dims.append(dim)
            continue
        return None
    return tuple(dims)


# The partial gradients summed in one buffer, at most: the buffer is a copy of them, so one
# buffer for every partial gradient of a large model (under cp, nearly every weight's)
# would double their memory when backward ends. A gradient larger than this is summed
# where it is, no copy.
FLAT_BYTES = 64 << 20


def _reduce_pending(flat_bytes: int | None = None) -> None:
    pending = _pending_params()
    params = list(pending)
    pending.clear()
    buckets: dict[tuple, tuple[list, list]] = {}
    for param in params:
        grad = param.grad
        if not isinstance(grad, DTensor) or tuple(grad.placements) == tuple(param.placements):
            continue
        dims = _summed_dims(grad.placements, param.placements)
        if dims is None:
            param.grad = grad.redistribute(param.device_mesh, param.placements)
            continue
        mesh = param.device_mesh
        groups = [mesh.get_group(dim) for dim in dims if mesh.size(dim) > 1]
        key = (grad.dtype, grad.device, tuple(id(group) for group in groups))
        buckets.setdefault(key, (groups, []))[1].append(param)
    limit = FLAT_BYTES if flat_bytes is None else flat_bytes
    for groups, members in buckets.values():
        for part in _bounded(members, limit):
            _sum_over(groups, part)


def _bounded(members: list, limit: int) -> list[list]:
    """``members`` (in order) cut into runs whose gradients add up to at most ``limit``
    bytes; a gradient larger than that is a run of its own."""
    runs, run, size = [], [], 0
    for param in members:
        local = param.grad._local_tensor
        nbytes = local.numel() * local.element_size()
        if run and size + nbytes > limit:
            runs.append(run)
            run, size = [], 0
        run.append(param)
        size += nbytes
    return runs + ([run] if run else [])


def _sum_over(groups: list, members: list) -> None:
    """The members' partial gradients summed over ``groups``, each ``param.grad`` then
    placed as its parameter is: several in one flat copy (one collective), a lone
    contiguous one in place (not one that carries a graph: a double backward's)."""
    locals_ = [param.grad.to_local() for param in members]
    if len(members) == 1 and locals_[0].is_contiguous() and not locals_[0].requires_grad:
        flat = locals_[0]
    else:
        flat = torch.cat([local.reshape(-1) for local in locals_])
    for group in groups:
        all_reduce_sum(flat.view(-1), group)
    offset = 0
    for param, local in zip(members, locals_):
        summed = flat.view(-1)[offset:offset + local.numel()].view(local.shape)
        offset += local.numel()
        param.grad = _replicated_grad(param, summed)


def _replicated_grad(param: DTensor, summed: torch.Tensor) -> DTensor:
    """The summed local gradient as a DTensor placed as ``param`` is: the parameter's own
    spec where the strides agree (what DTensor's ``to_local`` backward does), else
    ``from_local``."""
    if summed.stride() == param._local_tensor.stride():
        return DTensor(summed, copy.copy(param._spec), requires_grad=False)
    return DTensor.from_local(summed, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=summed.stride())
