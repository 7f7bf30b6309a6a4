"""``local_with_grad_placements`` is DTensor's ``to_local(grad_placements=...)`` with its
specs made once: the same gradient DTensor (spec and values), for replicated and sharded
parameters (whose global strides differ from the local ones) and for contiguous and
transposed gradients, and a double backward; and the summed gradient keeps the
parameter's placements."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from hyper_parallel.distributed.partial_grads import _replicated_grad, local_with_grad_placements
from tests.threaded_world import run_ranks


def _grad(param, local_of, transposed: bool, create_graph: bool = False):
    """The gradient as backward hands it to the parameter (``autograd.grad``: before
    AccumulateGrad, which would store a copy of its own)."""
    weights = torch.arange(float(param._local_tensor.numel())).view(param._local_tensor.shape)
    local = local_of(param)
    loss = ((local.t() * weights.t()) if transposed else (local * weights)).sum()
    if create_graph:
        loss = (local * local).sum()
    return torch.autograd.grad(loss, param, create_graph=create_graph)[0]


def _compare(rank):
    mesh = init_device_mesh("cpu", (2,))
    cases = []
    for placements, grads in (((Replicate(),), (Partial(),)), ((Shard(1),), (Shard(1),))):
        whole = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
        local = whole.chunk(2, dim=1)[rank].contiguous() if placements[0] == Shard(1) else whole
        param = torch.nn.Parameter(DTensor.from_local(local.clone(), mesh, placements, run_check=False,
                                                      shape=whole.shape, stride=whole.stride()))
        cache = {}
        for transposed in (False, True):
            theirs = _grad(param, lambda p: p.to_local(grad_placements=grads), transposed)
            ours = _grad(param, lambda p: local_with_grad_placements(p, grads, cache), transposed)
            cases.append((type(ours) is DTensor, ours._spec == theirs._spec and ours._spec.tensor_meta == theirs._spec.tensor_meta,
                          ours.stride() == theirs.stride(),
                          torch.equal(ours._local_tensor, theirs._local_tensor)))
        # a double backward (create_graph) keeps the gradient's own graph, as to_local's does
        theirs = _grad(param, lambda p: p.to_local(grad_placements=grads), False, create_graph=True)
        ours = _grad(param, lambda p: local_with_grad_placements(p, grads, cache), False, create_graph=True)
        cases.append((ours.requires_grad, theirs.requires_grad, ours._spec == theirs._spec,
                      torch.equal(ours._local_tensor, theirs._local_tensor)))
        summed = torch.ones_like(param._local_tensor)
        replicated = _replicated_grad(param, summed)
        cases.append((replicated.placements == param.placements, replicated.shape == param.shape,
                       replicated.stride() == param.stride(), replicated._local_tensor is summed))
    return cases


def test_the_gradient_is_the_dtensor_to_local_hands_on():
    for rank_cases in run_ranks(2, _compare):
        assert len(rank_cases) == 8
        for case in rank_cases:
            assert case == (True, True, True, True), rank_cases


def _bounded_sums(rank, flat_bytes):
    """Three replicated parameters (a weight, a transposed use of one, a bias) whose work
    is split (gradients Partial), their gradients summed when backward ends with buffers
    of at most ``flat_bytes``: each gradient against the sum of every rank's by hand."""
    from hyper_parallel.distributed import partial_grads

    mesh = init_device_mesh("cpu", (2,))
    generator = torch.Generator().manual_seed(0)
    wholes = [torch.randn(4, 6, generator=generator), torch.randn(6, 4, generator=generator),
              torch.randn(6, generator=generator)]
    params = []
    for whole in wholes:
        param = torch.nn.Parameter(DTensor.from_local(whole.clone(), mesh, (Replicate(),), run_check=False))
        param.register_post_accumulate_grad_hook(partial_grads.reduce_partial_grad)
        params.append(param)
    cache = {}
    rows = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))[rank]  # this rank's tokens
    original = partial_grads.FLAT_BYTES
    partial_grads.FLAT_BYTES = flat_bytes
    try:
        first, second, bias = (local_with_grad_placements(p, (Partial(),), cache) for p in params)
        ((rows @ first + bias) @ second).pow(2).sum().backward()
    finally:
        partial_grads.FLAT_BYTES = original
    # the same on each rank's tokens, by hand, summed
    expected = [torch.zeros_like(w) for w in wholes]
    for r in range(2):
        leaves = [w.clone().requires_grad_(True) for w in wholes]
        tokens = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))[r]
        ((tokens @ leaves[0] + leaves[2]) @ leaves[1]).pow(2).sum().backward()
        for total, leaf in zip(expected, leaves):
            total += leaf.grad
    return [(p.grad.placements == (Replicate(),), torch.allclose(p.grad.to_local(), total, rtol=1e-5, atol=1e-6))
            for p, total in zip(params, expected)]


def test_partial_gradients_are_summed_in_bounded_buffers():
    # 0: every gradient alone (summed in place); 100 bytes: runs cut by size (each weight
    # is 96 bytes, the bias 24); the default: all three in one buffer
    for flat_bytes in (0, 100, None):
        for rank_cases in run_ranks(2, lambda rank: _bounded_sums(rank, flat_bytes or (64 << 20))):
            assert rank_cases == [(True, True)] * 3, (flat_bytes, rank_cases)
