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
inside: backward keeps only the local K/V and gathers them again, so a rank's saved
activations hold no whole-sequence K/V, and hands back the local K/V gradients (the
exchange's reduce-scatter). Only where the fused CPU kernel is there (``_scaled_dot_product_flash_attention_for_cpu``)
and the attention is plain causal (no mask, softcap, window, sinks, dropout); the caller
falls back to the mask rows otherwise.
"""

import torch


def usable(query: torch.Tensor, dropout: float) -> bool:
    """Whether the mask-free path runs here: CPU tensors of a float type, no dropout."""
    return (query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and not dropout and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def _parts(chunk: int, size: int) -> list[tuple[int, int, bool]]:
    """(key start, key end, causal) of the calls for global chunk ``chunk`` of ``size``."""
    parts = [(0, chunk * size, False)] if chunk else []
    return parts + [(chunk * size, (chunk + 1) * size, True)]


def _repeat(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """[batch, kv heads, S, dim] -> [batch, kv heads * groups, S, dim] (transformers' repeat_kv)."""
    if groups == 1:
        return tensor
    batch, heads, length, dim = tensor.shape
    return tensor[:, :, None].expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)


def _summed(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``_repeat``: each kv head's query-head group summed."""
    if groups == 1:
        return grad
    batch, heads, length, dim = grad.shape
    return grad.view(batch, heads // groups, groups, length, dim).sum(2)


class _ChunkedCausal(torch.autograd.Function):
    """Saves the kv heads as given (not repeated per query head): this rank's K/V with an
    exchange, else the whole sequence's kv-head-sized K/V."""

    @staticmethod
    def forward(ctx, query, kv_key, kv_value, chunks: tuple[int, ...], size: int, scale: float, exchange):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        saved_key, saved_value = kv_key, kv_value
        if exchange is not None:
            kv_key, kv_value = exchange.whole(kv_key), exchange.whole(kv_value)
        groups = query.shape[1] // kv_key.shape[1]
        key, value = _repeat(kv_key, groups), _repeat(kv_value, groups)
        outputs, sums = [], []
        for index, chunk in enumerate(chunks):
            q = query[:, :, index * size:(index + 1) * size]
            merged_out, merged_lse = None, None
            for start, end, causal in _parts(chunk, size):
                out, lse = flash(q, key[:, :, start:end], value[:, :, start:end], 0.0, causal, scale=scale)
                if merged_out is None:
                    merged_out, merged_lse = out.float(), lse
                    continue
                total = torch.logaddexp(merged_lse, lse)
                merged_out = (merged_out * torch.exp(merged_lse - total).unsqueeze(-1)
                              + out.float() * torch.exp(lse - total).unsqueeze(-1))
                merged_lse = total
            outputs.append(merged_out.to(query.dtype))
            sums.append(merged_lse)
        # laid out [batch, tokens, heads, dim] in memory, as sdpa's CPU kernel returns it: the
        # caller's transpose(1, 2).contiguous() is then free and o_proj's saved input is this
        # very storage, not a second copy of the output
        out = torch.cat([piece.transpose(1, 2) for piece in outputs], dim=1).transpose(1, 2)
        ctx.save_for_backward(query, saved_key, saved_value, out, torch.cat(sums, dim=2))
        ctx.chunks, ctx.size, ctx.scale, ctx.groups, ctx.exchange = chunks, size, scale, groups, exchange
        return out

    @staticmethod
    def backward(ctx, grad):
        query, kv_key, kv_value, out, lse = ctx.saved_tensors
        size, scale, groups, exchange = ctx.size, ctx.scale, ctx.groups, ctx.exchange
        if exchange is not None:
            kv_key, kv_value = exchange.whole(kv_key), exchange.whole(kv_value)
        key, value = _repeat(kv_key, groups), _repeat(kv_value, groups)
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad = grad.contiguous()
        d_query, d_key, d_value = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        for index, chunk in enumerate(ctx.chunks):
            rows = slice(index * size, (index + 1) * size)
            for start, end, causal in _parts(chunk, size):
                # the kernel reads strided slices (no copies)
                dq, dk, dv = backward(grad[:, :, rows], query[:, :, rows], key[:, :, start:end],
                                      value[:, :, start:end], out[:, :, rows], lse[:, :, rows], 0.0, causal,
                                      scale=scale)
                d_query[:, :, rows] += dq
                d_key[:, :, start:end] += dk
                d_value[:, :, start:end] += dv
        d_key, d_value = _summed(d_key, groups), _summed(d_value, groups)
        if exchange is not None:
            d_key, d_value = exchange.local_grad(d_key), exchange.local_grad(d_value)
        return d_query, d_key, d_value, None, None, None, None


def chunked_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunks: tuple[int, ...],
                             scale: float, *, exchange=None) -> torch.Tensor:
    """Causal attention of ``query`` ([batch, heads, len(chunks)*C, dim], its rows the
    global chunks ``chunks`` of C tokens, in that order) against the whole sequence's
    ``key``/``value`` ([batch, kv heads, S, dim], natural order; kv heads divide heads),
    or, with ``exchange`` (``whole(local)`` / ``local_grad(grad)``), against this rank's
    K/V, which it gathers in forward and again in backward."""
    size = query.shape[2] // len(chunks)
    return _ChunkedCausal.apply(query.contiguous(), key.contiguous(), value.contiguous(), tuple(chunks), size,
                                float(scale), exchange)
