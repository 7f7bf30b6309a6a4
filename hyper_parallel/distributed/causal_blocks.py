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
With an ``exchange`` (allgather_kv: ``context_parallel.KvExchange``) the K/V arrive as
this rank's tokens, and the keys before its last chunk are gathered inside
(``exchange.earlier_async(key, value)``: only those, which are all its calls on earlier
keys read; ``exchange.local_grads_async(rows, size)`` its adjoint, their gradients to the
ranks that own them): backward keeps only the local K/V and gathers them again there, so
a rank's saved activations hold no other rank's K/V, and hands back the local K/V
gradients. Each collective runs while the rank computes on its own keys: the diagonal
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


class _WholeKv:
    """``KvExchange``'s part without one: the whole sequence's K/V are given (natural
    order), so the earlier keys are their first rows and the gradients stay here."""

    local = False

    def __init__(self, chunks: tuple[int, ...]):
        self.chunks = chunks

    def earlier_chunks(self) -> int:
        return max(self.chunks)

    def earlier_async(self, key, value):
        """The whole K/V: each call on earlier keys reads its first rows."""
        return lambda: (key, value)

    def local_grads_async(self, earlier, size: int):
        """The earlier keys' gradients are the whole sequence's first rows."""
        return lambda: [(0, earlier)]


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
        exchange = exchange if exchange is not None else _WholeKv(chunks)
        earlier = exchange.earlier_async(kv_key, kv_value)
        # laid out [batch, tokens, heads, dim] in memory, as sdpa's CPU kernel returns it: the
        # caller's transpose(1, 2).contiguous() is then free and o_proj's saved input is this
        # very storage, not a second copy of the output
        out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3]).transpose(1, 2)
        lse = query.new_empty(query.shape[:3], dtype=torch.float32)
        diagonal = []
        for index, chunk in enumerate(chunks):
            rows = slice(index * size, (index + 1) * size)
            key, value = _own_keys(kv_key, kv_value, index, chunk, size, exchange.local)
            diagonal.append(flash(query[:, :, rows], _repeat(key, groups), _repeat(value, groups), 0.0, True,
                                  scale=scale))
        key, value = (_repeat(tensor, groups) for tensor in earlier())
        for index, chunk in enumerate(chunks):
            rows, end = slice(index * size, (index + 1) * size), chunk * size
            if chunk:  # the keys before the chunk: no mask
                _merge_into(out[:, :, rows], lse[:, :, rows], *diagonal[index],
                            *flash(query[:, :, rows], key[:, :, :end], value[:, :, :end], 0.0, False, scale=scale))
            else:
                out[:, :, rows], lse[:, :, rows] = diagonal[index]
        ctx.save_for_backward(query, kv_key, kv_value, out, lse)
        ctx.chunks, ctx.size, ctx.scale, ctx.groups, ctx.exchange = chunks, size, scale, groups, exchange
        return out

    @staticmethod
    def backward(ctx, grad):
        query, kv_key, kv_value, out, lse = ctx.saved_tensors
        chunks, size, exchange = ctx.chunks, ctx.size, ctx.exchange
        earlier = exchange.earlier_async(kv_key, kv_value)
        grads = _BlockGrads(grad, query, kv_key, out, lse, ctx.scale, ctx.groups, size, exchange)
        # the diagonal calls (own keys) split in two: the first while the K/V arrive, the
        # last while the earlier keys' K/V gradients go to their ranks (with an exchange)
        before = len(chunks) - 1 if exchange.local and len(chunks) > 1 else len(chunks)
        for index in range(before):
            grads.diagonal(index, chunks[index], kv_key, kv_value)
        key, value = (_repeat(tensor, ctx.groups) for tensor in earlier())
        for index, chunk in enumerate(chunks):
            if chunk:
                grads.earlier(index, chunk, key, value)
        returned = exchange.local_grads_async(grads.earlier_grads, size)
        for index in range(before, len(chunks)):
            grads.diagonal(index, chunks[index], kv_key, kv_value)
        d_key, d_value = grads.local_grads(returned())
        return grads.d_query, d_key, d_value, None, None, None, None


def _merge_into(out, lse, diagonal_out, diagonal_lse, earlier_out, earlier_lse) -> None:
    """Two attention results over disjoint key sets (the chunk's own keys, the keys
    before it) as one, weighted by their log-sum-exp, written into ``out`` and ``lse``
    (summed in float32, rounded once to a lower precision ``out``)."""
    torch.logaddexp(diagonal_lse, earlier_lse, out=lse)
    first, second = torch.exp(diagonal_lse - lse).unsqueeze(-1), torch.exp(earlier_lse - lse).unsqueeze(-1)
    if out.dtype == torch.float32:
        torch.mul(diagonal_out, first, out=out)
        out.addcmul_(earlier_out, second)
    else:
        out.copy_(diagonal_out.float() * first + earlier_out.float() * second)


class _BlockGrads:
    """The gradients of ``_ChunkedCausal`` as its flash-backward calls come: the query's
    rows (each set by the first call on them, added to by the other) and the K/V
    gradients, summed per kv head (no query-head-sized buffers). The calls on earlier
    keys add to ``earlier_grads``, rows [tokens (natural order), K/V, batch, kv heads,
    dim] of the keys before the rank's last chunk, which go to the ranks that own them
    (``exchange.local_grads_async``); the diagonal calls fill ``own``, the same rows of
    the rank's K/V (with an exchange; without one, of the whole sequence's), to which
    ``local_grads`` adds what comes back. The kernel reads strided slices (no copies)."""

    def __init__(self, grad, query, kv_key, out, lse, scale: float, groups: int, size: int, exchange):
        self.grad, self.query, self.out, self.lse = grad, query, out, lse
        self.scale, self.groups, self.size, self.local = scale, groups, size, exchange.local
        self.d_query = torch.empty_like(query)
        batch, heads, length, dim = kv_key.shape
        self.earlier_grads = kv_key.new_zeros(exchange.earlier_chunks() * size, 2, batch, heads, dim)
        # with an exchange every row is some chunk's diagonal; the whole sequence's may have rows no chunk covers
        self.own = (kv_key.new_empty if self.local else kv_key.new_zeros)(length, 2, batch, heads, dim)
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
        start = (index if self.local else chunk) * self.size
        _add_rows(self.own, start, dk, dv, add=False)

    def earlier(self, index: int, chunk: int, key, value) -> None:
        """The ``index``-th chunk's queries against every key before the chunk (no mask)."""
        end = chunk * self.size
        dk, dv = self._call(index, key[:, :, :end], value[:, :, :end], False)
        _add_rows(self.earlier_grads, 0, dk, dv)

    def local_grads(self, parts: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V gradients ([batch, kv heads, tokens, dim]): ``own`` plus ``parts``
        ((first row, rows) from ``local_grads_async``)."""
        for start, rows in parts:
            self.own[start:start + rows.shape[0]] += rows
        return self.own[:, 0].permute(1, 2, 0, 3), self.own[:, 1].permute(1, 2, 0, 3)


def _add_rows(rows: torch.Tensor, start: int, d_key: torch.Tensor, d_value: torch.Tensor, add: bool = True) -> None:
    """K/V gradients [batch, kv heads, tokens, dim] into ``rows`` [tokens, K/V, batch, kv
    heads, dim] from row ``start``: added, or set (``add=False``)."""
    length = d_key.shape[2]
    for slot, grad in enumerate((d_key, d_value)):
        target = rows[start:start + length, slot]
        source = grad.permute(2, 0, 1, 3)
        if add:
            target += source
        else:
            target.copy_(source)


def _own_keys(kv_key, kv_value, index: int, chunk: int, size: int, local: bool):
    """The K/V of the ``index``-th of the rank's chunks (global chunk ``chunk``): rows of
    this rank's K/V (``local``) or of the whole sequence's."""
    start = index * size if local else chunk * size
    return kv_key[:, :, start:start + size], kv_value[:, :, start:start + size]


def _dense_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the flash kernels read it: any strides but a dense last dim (a
    transposed [batch, tokens, heads, dim] projection is read in place, not copied)."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def chunked_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunks: tuple[int, ...],
                             scale: float, *, exchange=None) -> torch.Tensor:
    """Causal attention of ``query`` ([batch, heads, len(chunks)*C, dim], its rows the
    global chunks ``chunks`` of C tokens, in that order) against the whole sequence's
    ``key``/``value`` ([batch, kv heads, S, dim], natural order; kv heads divide heads),
    or, with ``exchange`` (``context_parallel.KvExchange``), against this rank's K/V: it
    gathers the earlier keys' in forward and again in backward."""
    size = query.shape[2] // len(chunks)
    return _ChunkedCausal.apply(_dense_rows(query), _dense_rows(key), _dense_rows(value), tuple(chunks), size,
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
