"""The computation behind ``GroupedExperts``: routed rows grouped by expert, grouped
matmuls over them, and a hand-written backward.

Why a hand-written backward: autograd through per-expert matmuls keeps one node per
expert and projection, stacks the per-expert weight gradients at the end and saves
every intermediate; HF's eager loop is worse still (indexing the stacked weights per
expert gives each expert a full-size ``[E, ...]`` gradient to zero-fill and add).
Here forward and backward each walk the rows once, write the weight gradients in
place, and keep only the gate/up projection and act(gate) per row. The routing
weights' gradient ``<grad_out, down(act)>`` is taken as ``<down.T grad_out, act>``, so
the expert outputs (a hidden-size row per routed pair, the largest activation HF's
autograd keeps) are not kept. The rows keep HF's order (by expert, then k, then token)
and the forward and the down projection's gradients follow HF's autograd op for op:
fp32 outputs and down-projection gradients are bit-identical to HF's eager experts. The
gate/up gradients weight the gradient of act instead of the output's (``w * (g @ D)``
for HF's ``(w * g) @ D``): equal up to fp32 rounding, and in bf16 as close to the exact
result as HF's.

Two layouts of the same rows (``ExpertRows``):

* packed: exactly the routed (token, expert) pairs, grouped by expert; each expert's run
  of rows is one ``mm``. No wasted flops; the default on CPU, where a loop of ``mm``
  calls runs at the machine's matmul rate and padding would only add work.
* padded: every expert gets ``capacity`` rows and each projection is one ``bmm`` over
  ``[E, capacity, ...]``; padding rows read a zero token row and a zero routing weight,
  so they add nothing to any output or gradient. Few, large kernels: the default on
  accelerators while the padding stays bounded.

The rows are processed in blocks of whole experts, so the gathers, the activation and
the weighting run on a block at a time: fewer kernels than one expert at a time, less
memory traffic than all rows at once. How large a block is trades the two. Every
kernel is a parallel region whose threads must all arrive, and on a busy host (vCPUs
descheduled) that costs tens of microseconds per kernel whatever its size. Measured on
the 2-core machine here (``bench/grouped_experts.py``, small shape, step over the matmul
floor, 4 / 16 / 32 MiB blocks): 1.30 / 1.32 / 1.37 while the host is quiet, 1.49 / 1.39
/ 1.33 while it is busy; ``BLOCK_BYTES`` is the size that stays low in both.
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from transformers.activations import SiLUActivation

from hyper_parallel.platform.host_values import counts_to_host

# A block's working set (gathered rows, projections, activation, output) stays under this.
BLOCK_BYTES = 16 << 20


@dataclass(frozen=True)
class ExpertBlock:
    """Rows ``start:stop``, owned by experts ``first, first+1, ...`` with ``sizes`` rows each."""

    first: int
    sizes: list[int]
    start: int
    stop: int

    @property
    def span(self) -> slice:
        return slice(self.start, self.stop)

    @property
    def count(self) -> int:
        return self.stop - self.start


class ExpertRoutes:
    """The routed (token, expert) pairs sorted by expert; ``counts`` rows per expert."""

    def __init__(self, pair: torch.Tensor, token: torch.Tensor, expert: torch.Tensor,
                 counts: torch.Tensor, counts_list: list[int]) -> None:
        self.pair = pair  # index into the flattened [T*K] routing arrays
        self.token = token
        self.expert = expert
        self.counts = counts
        self.counts_list = counts_list
        self.count = sum(counts_list)
        self.capacity = max(counts_list, default=0)

    @classmethod
    def of(cls, top_k_index: torch.Tensor, num_experts: int) -> "ExpertRoutes":
        """``top_k_index`` [T, K]. Expert ids outside ``[0, num_experts)`` (an
        expert-parallel sentinel) select nothing."""
        num_tokens, top_k = top_k_index.shape
        # Within an expert, rows in HF's torch.where order over [K, T] (by k, then token),
        # so the weight gradients sum their rows in HF's order too. Stable sort keeps it.
        expert, position = torch.sort(top_k_index.t().reshape(-1), stable=True)
        # Counted into a fixed-size tensor (bincount's size depends on the largest id: no fake-tensor shape)
        counts = torch.zeros(num_experts + 1, dtype=torch.long, device=expert.device).index_add_(
            0, expert.clamp(max=num_experts), torch.ones_like(expert))[:num_experts]
        counts_list = counts_to_host(counts, top_k_index.numel())  # one host sync: the counts size all below
        routed = sum(counts_list)
        position, expert = position[:routed], expert[:routed]  # sentinels (id >= E) sort last
        token = position % num_tokens
        return cls(token * top_k + position // num_tokens, token, expert, counts, counts_list)

    @property
    def padded_size(self) -> int:
        return len(self.counts_list) * self.capacity


class ExpertRows:
    """Which rows the experts compute, grouped by expert: row r is routed pair ``pair[r]``
    (an index into the flattened ``[T*K]`` routing) of token ``token[r]``; expert e owns
    the next ``sizes[e]`` rows. In the padded layout, padding rows have ``token == T`` (a
    zero row appended to the tokens) and ``pair == T*K`` (a discarded slot)."""

    def __init__(self, token: torch.Tensor, pair: torch.Tensor, sizes: list[int], padded: bool) -> None:
        self.token = token
        self.pair = pair
        self.sizes = sizes
        self.padded = padded

    @classmethod
    def packed(cls, routes: ExpertRoutes) -> "ExpertRows":
        return cls(routes.token, routes.pair, routes.counts_list, padded=False)

    @classmethod
    def padded_to_capacity(cls, routes: ExpertRoutes, num_tokens: int, num_pairs: int) -> "ExpertRows":
        """Expert e owns rows ``e*C .. e*C+C`` (C: the busiest expert's row count)."""
        capacity, num_experts = routes.capacity, len(routes.counts_list)
        starts = torch.cumsum(routes.counts, 0) - routes.counts
        rank_in_expert = torch.arange(routes.count, device=routes.pair.device) - starts[routes.expert]
        slot = routes.expert * capacity + rank_in_expert
        token = routes.token.new_full((num_experts * capacity,), num_tokens).index_copy_(0, slot, routes.token)
        pair = routes.pair.new_full((num_experts * capacity,), num_pairs).index_copy_(0, slot, routes.pair)
        return cls(token, pair, [capacity] * num_experts, padded=True)

    @property
    def count(self) -> int:
        return self.token.shape[0]

    def blocks(self, row_bytes: int) -> list[ExpertBlock]:
        """Consecutive experts per block, up to ``BLOCK_BYTES`` of rows (at least one
        expert); the padded layout is one block, so each projection is one ``bmm``."""
        if self.padded:
            return [ExpertBlock(0, self.sizes, 0, self.count)]
        max_rows = max(1, BLOCK_BYTES // row_bytes)
        blocks, first, start, rows = [], 0, 0, 0
        for expert, size in enumerate(self.sizes):
            if rows and rows + size > max_rows:
                blocks.append(ExpertBlock(first, self.sizes[first:expert], start, start + rows))
                first, start, rows = expert, start + rows, 0
            rows += size
        blocks.append(ExpertBlock(first, self.sizes[first:], start, start + rows))
        return blocks


def grouped_mm_experts(hidden: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                       routes: ExpertRoutes, activation) -> torch.Tensor:
    """The same computation through torch's grouped matmul kernel (``torch._grouped_mm``,
    what transformers' ``grouped_mm`` experts call; on CUDA one kernel per projection over
    every expert's rows, no padding) with torch's autograd for the backward. The rows keep
    ``routes``' order (by expert, then k, then token); each expert's run ends at ``offs``."""
    offs = torch.cumsum(routes.counts, 0).to(torch.int32)
    rows = hidden[routes.token]
    gate, up = torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    out = torch._grouped_mm(activation(gate) * up, down.transpose(-2, -1), offs=offs)
    out = out * weights.reshape(-1)[routes.pair].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(hidden).index_add(0, routes.token, out.to(hidden.dtype))


def routed_experts(hidden: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   rows: ExpertRows, act_fn: nn.Module) -> torch.Tensor:
    """``sum_k weights[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t))`` over the rows, as ``[T, H]``."""
    return _RoutedExperts.apply(hidden, weights, gate_up, down, rows, _activation_for(act_fn))


class _RoutedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weights, gate_up, down, rows: ExpertRows, activation):
        source = _with_zero_row(hidden) if rows.padded else hidden
        row_weight = _with_zero_row(weights.reshape(-1)).index_select(0, rows.pair)[:, None]
        expert_pass = _ExpertPass(source, gate_up, down, rows, activation)
        # Kept for backward, only when it needs them: the gate/up projection and act(gate).
        kept = _Kept(hidden, rows.count, expert_pass.half, keep=any(ctx.needs_input_grad[:4]))
        out = torch.zeros_like(source)
        for block in expert_pass.blocks:
            expert_pass.forward_block(block, row_weight, kept, out)
        ctx.save_for_backward(source, gate_up, down, kept.gate_up, kept.act_gate, row_weight)
        ctx.rows, ctx.activation, ctx.weights_shape = rows, activation, weights.shape
        return out[:hidden.shape[0]] if rows.padded else out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        source, gate_up, down, kept_gate_up, kept_act_gate, row_weight = ctx.saved_tensors
        rows = ctx.rows
        need_hidden, need_weights, need_gate_up, need_down = ctx.needs_input_grad[:4]
        expert_pass = _ExpertPass(source, gate_up, down, rows, ctx.activation)
        grads = _Grads(source, row_weight, gate_up, down, rows, need_hidden, need_weights, need_gate_up, need_down)
        grad_source = _with_zero_row(grad_out) if rows.padded else grad_out
        for block in expert_pass.blocks:
            expert_pass.backward_block(block, grad_source, row_weight, kept_gate_up, kept_act_gate, grads)
        return (*grads.of_inputs(ctx.weights_shape, rows.padded), None, None)


class _ExpertPass:
    """One walk over the rows, a block of whole experts at a time."""

    def __init__(self, source, gate_up, down, rows: ExpertRows, activation) -> None:
        self.source, self.gate_up, self.down, self.rows, self.activation = source, gate_up, down, rows, activation
        self.half, self.hidden_size = gate_up.shape[1] // 2, source.shape[1]
        self.blocks = rows.blocks(source.element_size() * (3 * self.hidden_size + 4 * self.half))
        self.scratch = _Scratch(source, max(block.stop - block.start for block in self.blocks))

    def forward_block(self, block: ExpertBlock, row_weight, kept: "_Kept", out) -> None:
        """Adds the block's rows to ``out``: each row's expert output times its routing weight."""
        half, hidden_size, scratch, padded = self.half, self.hidden_size, self.scratch, self.rows.padded
        token, span, count = self.rows.token[block.start:block.stop], block.span, block.count
        input_rows = torch.index_select(self.source, 0, token, out=scratch.take("input", count, hidden_size))
        gate_up_rows = _grouped_mm(input_rows, self.gate_up, block, padded, transpose=True,
                                   out=kept.rows("gate_up", span, scratch, count, 2 * half))
        act_gate = self.activation.forward(gate_up_rows[:, :half],
                                           out=kept.rows("act_gate", span, scratch, count, half))
        act = torch.mul(act_gate, gate_up_rows[:, half:], out=scratch.take("act", count, half))
        expert_out = _grouped_mm(act, self.down, block, padded, transpose=True,
                                 out=scratch.take("expert_out", count, hidden_size))
        # Weighted in the output dtype, then summed per token in expert order: HF's order.
        out.index_add_(0, token, expert_out.mul_(row_weight[span]))

    def backward_block(self, block: ExpertBlock, grad_source, row_weight, kept_gate_up, kept_act_gate,
                       grads: "_Grads") -> None:
        """The down projection's gradients in HF's order (the output gradient weighted, then
        the matmul); the rest from the unweighted gradient of act, weighted after."""
        half, scratch, padded = self.half, self.scratch, self.rows.padded
        token, span, count = self.rows.token[block.start:block.stop], block.span, block.count
        gate, up, act_gate = kept_gate_up[span, :half], kept_gate_up[span, half:], kept_act_gate[span]
        weight = row_weight[span]
        grad_rows = torch.index_select(grad_source, 0, token, out=scratch.take("grad_rows", count, self.hidden_size))
        grad_act = _grouped_mm(grad_rows, self.down, block, padded, transpose=False,
                               out=scratch.take("grad_act", count, half))
        if grads.row_weight is not None or grads.down is not None:  # not for frozen experts and weights
            act = torch.mul(act_gate, up, out=scratch.take("act", count, half))
        if grads.row_weight is not None:
            # d(weight) = <grad_out, down(act)> = <down.T grad_out, act>: no expert output kept.
            torch.linalg.vecdot(grad_act, act, out=grads.row_weight[span])
        if grads.down is not None:
            _grouped_weight_grad(grad_rows.mul_(weight), act, block, padded, out=grads.down)
        grad_act.mul_(weight)
        grad_gate_up = scratch.take("grad_gate_up", count, 2 * half)
        torch.mul(grad_act, act_gate, out=grad_gate_up[:, half:])
        self.activation.backward(grad_act.mul_(up), gate, out=grad_gate_up[:, :half])
        if grads.gate_up is not None:
            input_rows = torch.index_select(self.source, 0, token, out=scratch.take("input", count, self.hidden_size))
            _grouped_weight_grad(grad_gate_up, input_rows, block, padded, out=grads.gate_up)
        if grads.source is not None:
            grad_input = _grouped_mm(grad_gate_up, self.gate_up, block, padded, transpose=False, out=grad_rows)
            grads.source.index_add_(0, token, grad_input)


class _Kept:
    """The row buffers forward keeps for backward (``None`` when backward has no use)."""

    def __init__(self, like, num_rows: int, half: int, *, keep: bool) -> None:
        self.gate_up = like.new_empty(num_rows, 2 * half) if keep else None
        self.act_gate = like.new_empty(num_rows, half) if keep else None

    def rows(self, name: str, span: slice, scratch: "_Scratch", count: int, width: int) -> torch.Tensor:
        """Rows ``span`` of the kept buffer ``name``, or block-sized scratch."""
        buffer = getattr(self, name)
        return buffer[span] if buffer is not None else scratch.take(name, count, width)


class _Scratch:
    """Block-sized tensors reused from block to block."""

    def __init__(self, like: torch.Tensor, max_rows: int) -> None:
        self.like, self.max_rows, self.tensors = like, max_rows, {}

    def take(self, name: str, count: int, width: int) -> torch.Tensor:
        if name not in self.tensors:
            self.tensors[name] = self.like.new_empty(self.max_rows, width)
        return self.tensors[name][:count]


class _Grads:
    """Gradients being accumulated; ``None`` for inputs that need none. Weight gradients
    are written per expert in place; experts without rows get zeros."""

    def __init__(self, source, row_weight, gate_up, down, rows: ExpertRows, need_hidden: bool, need_weights: bool,
                 need_gate_up: bool, need_down: bool) -> None:
        self.source = torch.zeros_like(source) if need_hidden else None
        self.row_weight = row_weight.new_zeros(rows.count) if need_weights else None
        self.gate_up = torch.empty_like(gate_up) if need_gate_up else None
        self.down = torch.empty_like(down) if need_down else None
        self.pair = rows.pair
        for expert, size in enumerate(rows.sizes):
            for grad in (self.gate_up, self.down):
                if size == 0 and grad is not None:
                    grad[expert].zero_()

    def of_inputs(self, weights_shape: torch.Size, padded: bool) -> tuple:
        """(hidden, weights, gate_up, down) gradients; padding rows' shares dropped."""
        grad_hidden = self.source[:-1] if padded and self.source is not None else self.source
        grad_weights = None
        if self.row_weight is not None:
            flat = self.row_weight.new_zeros(weights_shape.numel() + 1).index_add_(0, self.pair, self.row_weight)
            grad_weights = flat[:-1].view(weights_shape)
        return grad_hidden, grad_weights, self.gate_up, self.down


def _grouped_mm(rows, weight, block: ExpertBlock, padded: bool, *, out, transpose: bool):
    """``out[r] = rows[r] @ W_e.T`` (``transpose``) or ``rows[r] @ W_e`` for each row's expert e."""
    stacked = weight[block.first:block.first + len(block.sizes)]
    if transpose:
        stacked = stacked.transpose(1, 2)
    if padded:
        torch.bmm(rows.view(len(block.sizes), -1, rows.shape[-1]), stacked,
                  out=out.view(len(block.sizes), -1, out.shape[-1]))
        return out
    for chunk, expert_weight, out_chunk in zip(torch.split_with_sizes(rows, block.sizes), stacked.unbind(0),
                                               torch.split_with_sizes(out, block.sizes)):
        if chunk.shape[0]:
            torch.mm(chunk, expert_weight, out=out_chunk)
    return out


def _grouped_weight_grad(grad_rows, input_rows, block: ExpertBlock, padded: bool, *, out) -> None:
    """``out[e] = grad_rows_e.T @ input_rows_e`` for each expert of the block."""
    grads = out[block.first:block.first + len(block.sizes)]
    if padded:
        count = len(block.sizes)
        torch.bmm(grad_rows.view(count, -1, grad_rows.shape[-1]).transpose(1, 2),
                  input_rows.view(count, -1, input_rows.shape[-1]), out=grads)
        return
    for grad_chunk, input_chunk, grad in zip(torch.split_with_sizes(grad_rows, block.sizes),
                                             torch.split_with_sizes(input_rows, block.sizes), grads.unbind(0)):
        if grad_chunk.shape[0]:
            torch.mm(grad_chunk.t(), input_chunk, out=grad)


def _with_zero_row(tensor: torch.Tensor) -> torch.Tensor:
    return torch.cat([tensor, tensor.new_zeros((1, *tensor.shape[1:]))])


class _SiLU:
    """SiLU with its fused backward kernel."""

    @staticmethod
    def forward(gate, *, out):
        return torch.ops.aten.silu.out(gate, out=out)

    @staticmethod
    def backward(grad, gate, *, out):
        return torch.ops.aten.silu_backward.grad_input(grad, gate, grad_input=out)


class _AnyActivation:
    """Any elementwise activation module; its derivative comes from autograd on a recompute."""

    def __init__(self, act_fn: nn.Module) -> None:
        self.act_fn = act_fn

    def forward(self, gate, *, out):
        return out.copy_(self.act_fn(gate))

    def backward(self, grad, gate, *, out):
        with torch.enable_grad():
            leaf = gate.detach().requires_grad_()
            (grad_gate,) = torch.autograd.grad(self.act_fn(leaf), leaf, grad)
        return out.copy_(grad_gate)


def _activation_for(act_fn: nn.Module):
    return _SiLU if type(act_fn) in (nn.SiLU, SiLUActivation) else _AnyActivation(act_fn)
