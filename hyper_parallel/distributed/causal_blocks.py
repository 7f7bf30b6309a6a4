"""Causal attention of a rank's query chunks against the gathered keys, without a mask.

Under ``allgather_kv`` a rank's queries are one or two chunks of the sequence (chunk c:
positions c*C .. (c+1)*C-1). A query of chunk c sees every key before the chunk and,
causally, the keys of its own chunk. Handing sdpa the mask rows for that materializes an
[L, S] mask, which the CPU kernel turns into a float bias and keeps for backward: more
activation memory than the whole-sequence attention it replaces, whose ``is_causal``
needs none. Instead each chunk is two mask-free flash-attention calls, merged by their
log-sum-exp (the ring-attention decomposition):

- the keys before the chunk, no mask (absent for chunk 0);
- the chunk's own keys, ``is_causal`` (equal lengths: top-left causal is the true one).

Backward runs the flash backward of each call with the *merged* output and log-sum-exp,
which gives each call's exact share of the gradient (softmax over the union of keys).
With an ``exchange`` (allgather_kv) the K/V arrive as this rank's tokens and are gathered
inside (``exchange.whole_async(key, value)``; ``exchange.local_grad_async(d_key, d_value)``
its adjoint, the reduce-scatter): backward keeps only the local K/V and gathers them again
there, so a rank's saved activations hold no whole-sequence K/V, and hands back the local
K/V gradients. Each collective runs while the rank computes on its own keys: the diagonal
calls (the rank's own K/V only) wait for nothing, so forward runs them while the K/V
arrive, and backward runs the first of them while the K/V arrive again and the last while
the earlier keys' K/V gradients go to the ranks that own them (its own gradients never
leave the rank). Only where the fused CPU kernel is there (``_scaled_dot_product_flash_attention_for_cpu``)
and the attention is plain causal (no mask, softcap, window, sinks, dropout); the caller
falls back to the mask rows otherwise.
"""

import functools

import torch


def usable(query: torch.Tensor, dropout: float) -> bool:
    """Whether the mask-free path runs here: CPU tensors of a float type, no dropout."""
    return (query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and not dropout and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def _diagonal(chunk: int, size: int) -> tuple[int, int]:
    """(key start, key end) of global chunk ``chunk``'s own keys: its causal call."""
    return chunk * size, (chunk + 1) * size


def _merge(merged: tuple | None, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention results over disjoint key sets as one: weighted by log-sum-exp."""
    if merged is None:
        return out.float(), lse
    merged_out, merged_lse = merged
    total = torch.logaddexp(merged_lse, lse)
    return (merged_out * torch.exp(merged_lse - total).unsqueeze(-1)
            + out.float() * torch.exp(lse - total).unsqueeze(-1)), total


@functools.cache
def _kernel_takes_kv_heads() -> bool:
    """Whether the CPU flash kernels take fewer K/V heads than query heads themselves
    (grouped-query attention: forward reads each kv head for its query-head group, backward
    returns the K/V gradients summed per kv head). Then K/V are never repeated per query
    head: no copies of them in forward or backward, nor the sums of their gradients."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    query, key = torch.zeros(1, 2, 4, 8), torch.zeros(1, 1, 4, 8)
    try:
        out, lse = flash(query, key, key, 0.0, True, scale=1.0)
        _, grad_key, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            out, query, key, key, out, lse, 0.0, True, scale=1.0)
    except RuntimeError:  # an older kernel: K/V repeated per query head
        return False
    return grad_key.shape == key.shape


def _repeat(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """[batch, kv heads, S, dim] -> [batch, kv heads * groups, S, dim] (transformers' repeat_kv),
    where the kernels need it (``_kernel_takes_kv_heads``)."""
    if groups == 1 or _kernel_takes_kv_heads():
        return tensor
    batch, heads, length, dim = tensor.shape
    return tensor[:, :, None].expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)


def _summed(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``_repeat``: each kv head's query-head group summed."""
    if groups == 1 or _kernel_takes_kv_heads():
        return grad
    batch, heads, length, dim = grad.shape
    return grad.view(batch, heads // groups, groups, length, dim).sum(2)


class _ChunkedCausal(torch.autograd.Function):
    """Saves the kv heads as given (not repeated per query head): this rank's K/V with an
    exchange, else the whole sequence's kv-head-sized K/V. Each chunk's diagonal call needs
    only its own keys, which with an exchange are this rank's: they run while a
    collective is in flight (see the module docstring), the calls on earlier keys after
    the K/V have arrived."""

    @staticmethod
    def forward(ctx, query, kv_key, kv_value, chunks: tuple[int, ...], size: int, scale: float, exchange):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        groups = query.shape[1] // kv_key.shape[1]
        whole = exchange.whole_async(kv_key, kv_value) if exchange is not None else None
        merged = []
        for index, chunk in enumerate(chunks):
            rows = slice(index * size, (index + 1) * size)
            key, value = _own_keys(kv_key, kv_value, index, chunk, size, exchange is not None)
            merged.append(_merge(None, *flash(query[:, :, rows], _repeat(key, groups), _repeat(value, groups),
                                              0.0, True, scale=scale)))
        key, value = _earlier_keys(whole() if whole is not None else (kv_key, kv_value), chunks, size, groups)
        for index, chunk in enumerate(chunks):
            if chunk:  # the keys before the chunk: no mask
                rows, end = slice(index * size, (index + 1) * size), chunk * size
                merged[index] = _merge(merged[index], *flash(query[:, :, rows], key[:, :, :end], value[:, :, :end],
                                                             0.0, False, scale=scale))
        # laid out [batch, tokens, heads, dim] in memory, as sdpa's CPU kernel returns it: the
        # caller's transpose(1, 2).contiguous() is then free and o_proj's saved input is this
        # very storage, not a second copy of the output
        out = torch.cat([piece.to(query.dtype).transpose(1, 2) for piece, _ in merged], dim=1).transpose(1, 2)
        ctx.save_for_backward(query, kv_key, kv_value, out, torch.cat([lse for _, lse in merged], dim=2))
        ctx.chunks, ctx.size, ctx.scale, ctx.groups, ctx.exchange = chunks, size, scale, groups, exchange
        return out

    @staticmethod
    def backward(ctx, grad):
        query, kv_key, kv_value, out, lse = ctx.saved_tensors
        chunks, size, exchange = ctx.chunks, ctx.size, ctx.exchange
        whole = exchange.whole_async(kv_key, kv_value) if exchange is not None else None
        grads = _BlockGrads(grad.contiguous(), query, kv_key, out, lse, ctx.scale, ctx.groups, size,
                            exchange.size if exchange is not None else None)
        # the diagonal calls (own keys) split in two: the first while the K/V arrive, the
        # last while the earlier keys' K/V gradients go to their ranks (with an exchange)
        before = len(chunks) - 1 if exchange is not None and len(chunks) > 1 else len(chunks)
        for index in range(before):
            grads.diagonal(index, chunks[index], kv_key, kv_value)
        key, value = _earlier_keys(whole() if whole is not None else (kv_key, kv_value), chunks, size, ctx.groups)
        for index, chunk in enumerate(chunks):
            if chunk:
                grads.earlier(index, chunk, key, value)
        if exchange is None:
            return grads.d_query, grads.d_key, grads.d_value, None, None, None, None
        exchanged = exchange.local_grad_async(grads.d_key, grads.d_value)
        for index in range(before, len(chunks)):
            grads.diagonal(index, chunks[index], kv_key, kv_value)
        d_key, d_value = exchanged()
        return grads.d_query, d_key + grads.own_key, d_value + grads.own_value, None, None, None, None


class _BlockGrads:
    """The gradients of ``_ChunkedCausal`` as its flash-backward calls come: the query's
    rows (each set by the first call on them, added to by the other) and the K/V
    gradients, summed per kv head (no query-head-sized buffers). The calls on earlier
    keys add to the whole sequence's K/V gradients (natural order); the diagonal calls,
    with an exchange (``ranks``: the cp size), fill buffers the size of this rank's K/V,
    which the caller adds to what the exchange hands back (they never leave the rank),
    else they add to the whole sequence's too. The kernel reads strided slices (no copies)."""

    def __init__(self, grad, query, kv_key, out, lse, scale: float, groups: int, size: int, ranks: int | None):
        self.grad, self.query, self.out, self.lse = grad, query, out, lse
        self.scale, self.groups, self.size, self.local = scale, groups, size, ranks is not None
        self.d_query = torch.empty_like(query)
        length = kv_key.shape[2] * (ranks or 1)
        self.d_key = kv_key.new_zeros(*kv_key.shape[:2], length, kv_key.shape[3])
        self.d_value = torch.zeros_like(self.d_key)
        self.own_key = torch.empty_like(kv_key) if self.local else None
        self.own_value = torch.empty_like(kv_key) if self.local else None
        self.written: set[int] = set()

    def _call(self, index: int, key, value, causal: bool):
        rows = slice(index * self.size, (index + 1) * self.size)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            self.grad[:, :, rows], self.query[:, :, rows], key, value, self.out[:, :, rows], self.lse[:, :, rows],
            0.0, causal, scale=self.scale)
        if index in self.written:
            self.d_query[:, :, rows] += dq
        else:
            self.d_query[:, :, rows] = dq
            self.written.add(index)
        return _summed(dk, self.groups), _summed(dv, self.groups)

    def diagonal(self, index: int, chunk: int, kv_key, kv_value) -> None:
        """The ``index``-th chunk's queries against its own keys (causal)."""
        key, value = _own_keys(kv_key, kv_value, index, chunk, self.size, self.local)
        dk, dv = self._call(index, _repeat(key, self.groups), _repeat(value, self.groups), True)
        if self.local:
            self.own_key[:, :, index * self.size:(index + 1) * self.size] = dk
            self.own_value[:, :, index * self.size:(index + 1) * self.size] = dv
        else:
            start, end = _diagonal(chunk, self.size)
            self.d_key[:, :, start:end] += dk
            self.d_value[:, :, start:end] += dv

    def earlier(self, index: int, chunk: int, key, value) -> None:
        """The ``index``-th chunk's queries against every key before the chunk (no mask)."""
        end = chunk * self.size
        dk, dv = self._call(index, key[:, :, :end], value[:, :, :end], False)
        self.d_key[:, :, :end] += dk
        self.d_value[:, :, :end] += dv


def _earlier_keys(whole: tuple[torch.Tensor, torch.Tensor], chunks: tuple[int, ...], size: int, groups: int):
    """The whole sequence's K/V up to the last chunk's start (what the calls on earlier
    keys read), repeated per query head."""
    end = max(chunks) * size
    return tuple(_repeat(tensor[:, :, :end], groups) for tensor in whole)


def _own_keys(kv_key, kv_value, index: int, chunk: int, size: int, local: bool):
    """The K/V of the ``index``-th of the rank's chunks (global chunk ``chunk``): rows of
    this rank's K/V (``local``) or of the whole sequence's."""
    start = index * size if local else chunk * size
    return kv_key[:, :, start:start + size], kv_value[:, :, start:start + size]


def chunked_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunks: tuple[int, ...],
                             scale: float, *, exchange=None) -> torch.Tensor:
    """Causal attention of ``query`` ([batch, heads, len(chunks)*C, dim], its rows the
    global chunks ``chunks`` of C tokens, in that order) against the whole sequence's
    ``key``/``value`` ([batch, kv heads, S, dim], natural order; kv heads divide heads),
    or, with ``exchange`` (``whole_async(key, value)`` / ``local_grad_async(d_key, d_value)``), against this rank's
    K/V, which it gathers in forward and again in backward."""
    size = query.shape[2] // len(chunks)
    return _ChunkedCausal.apply(query.contiguous(), key.contiguous(), value.contiguous(), tuple(chunks), size,
                                float(scale), exchange)


class _HeadSplitAttention(torch.autograd.Function):
    """ulysses' inner attention by the flash kernel: q/k/v exchanged to this rank's head
    group over the whole sequence, attended, and the output exchanged back to this rank's
    tokens. Saved: q and the kv-head-sized K/V in the head layout, the log-sum-exp, and
    the output in the token layout it is returned in (what o_proj keeps as its input);
    backward exchanges that output and the gradient back to the head layout."""

    @staticmethod
    def forward(ctx, query, key, value, causal: bool, scale: float, exchange):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        query = exchange.to_heads(query)
        key, value = _paired(exchange.to_heads, key, value)
        groups = query.shape[1] // key.shape[1]
        out, lse = flash(query, _repeat(key, groups), _repeat(value, groups), 0.0, causal, scale=scale)
        local = exchange.to_tokens(out)
        ctx.save_for_backward(query, key, value, local, lse)
        ctx.causal, ctx.scale, ctx.groups, ctx.exchange = causal, scale, groups, exchange
        return local

    @staticmethod
    def backward(ctx, grad):
        query, key, value, local, lse = ctx.saved_tensors
        exchange, groups = ctx.exchange, ctx.groups
        out, grad = _paired(exchange.to_heads, local.transpose(1, 2), grad.transpose(1, 2))
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        dq, dk, dv = backward(grad, query, _repeat(key, groups), _repeat(value, groups), out, lse, 0.0,
                              ctx.causal, scale=ctx.scale)
        dk, dv = _paired(exchange.heads_of, _summed(dk, groups), _summed(dv, groups))
        return exchange.heads_of(dq), dk, dv, None, None, None


def _paired(exchange, first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two tensors of one shape through one exchange (one all-to-all), stacked on the batch dim."""
    both = exchange(torch.cat([first, second]))
    return both[:first.shape[0]], both[first.shape[0]:]


def head_split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float,
                         exchange) -> torch.Tensor:
    """ulysses' attention of this rank's tokens ``query`` [batch, heads, local tokens,
    dim] and ``key``/``value`` [batch, kv heads, local tokens, dim] (``exchange``:
    ``to_heads`` / ``to_tokens`` / ``heads_of``): the output [batch, local tokens, heads, dim]."""
    return _HeadSplitAttention.apply(query.contiguous(), key.contiguous(), value.contiguous(), bool(causal),
                                     float(scale), exchange)
