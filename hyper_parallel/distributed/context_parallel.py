"""Context parallel attention that splits the attention work: ``allgather_kv``.

With ``accelerator.context_parallel.algorithm: allgather_kv`` the plan keeps each cp
rank's tokens through the whole decoder block (``sequence_layout``: role
``kv_gathered_attention``). This module makes the attention itself right on them:

- the attention function: every module that calls transformers' attention interface
  (``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``) is routed through
  ``hyper_cp_sdpa`` / ``hyper_cp_eager`` (registered with ``AttentionInterface``, and with
  ``AttentionMaskInterface`` so ``create_causal_mask`` builds the same full-sequence mask
  it builds for sdpa / eager). On a module of a planned attention block the wrapper
  gathers K and V over cp (``gather_kv``: all-gather forward, the matching reduce-scatter
  backward), takes the mask rows of the rank's own global query positions (building the
  causal rows itself where sdpa would have used ``is_causal``), and calls the inner
  implementation: transformers' sdpa, or the model file's own ``eager_attention_forward``.
  The project's own attention modules call ``gather_kv`` directly (class attribute
  ``hyper_gathers_kv_over_cp``).
- ``ulysses`` instead: the wrapper exchanges q, k and v all-to-all over cp from [the
  rank's tokens, every local head] to [the whole sequence, the rank's group of heads]
  (``_sequence_to_heads``), calls the inner implementation on the whole sequence with the
  model's own mask (or sdpa's ``is_causal``), and exchanges the output back; tp*cp must
  divide the query and kv heads (the planner refuses otherwise).
- the rotary position embeddings (``position_embeddings`` = (cos, sin)) and
  ``position_ids`` the model computed for the whole sequence are sliced to the rank's
  tokens as they enter the block (a forward pre-hook).
- load balance (``SequenceOrder``): causal attention gives the last tokens the most work,
  so the sequence is cut into 2*cp chunks and rank r holds chunks r and 2*cp-1-r. The cp
  split operates on the *permuted* sequence (c0, c_{2cp-1}, c1, c_{2cp-2}, ...): a
  contiguous Shard(1) over cp of it gives each rank its two chunks, and every per-token
  module works unchanged. The applier permutes where the plan splits the sequence over cp
  and restores the order where it gathers it; the positions, mask rows, gathered K/V and
  the sharded loss's labels use the same permutation (``balanced_order``).
"""

import logging
import sys

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel.distributed import causal_blocks
from hyper_parallel.distributed.exchange import (all_gather_async, consecutive_rows, exchange_rows_async,
                                                 reduce_scatter_async)
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.protocols.axes import CP

logger = logging.getLogger(__name__)

CP_AXIS = CP
ATTENTION_NAMES = {"sdpa": "hyper_cp_sdpa", "eager": "hyper_cp_eager"}
CONTEXT_ATTRIBUTE = "_hyper_cp_attention"
# A module class of the project's own whose forward does the cp work itself (allgather_kv
# and ulysses: ``models/common``'s ``BaseAttention``), for a model that has no attention
# interface to route.
OWN_ATTENTION_MARK = "hyper_splits_attention_over_cp"
# The roles of the attention blocks that keep each cp rank's tokens, and the algorithm each
# runs: the planner (planning/sequence_layout.py) gives them, the applier installs it.
TOKEN_ATTENTION_ROLES = {"kv_gathered_attention": "allgather_kv", "ulysses_attention": "ulysses"}
ATTENTION_ROLE = {algorithm: role for role, algorithm in TOKEN_ATTENTION_ROLES.items()}


class ContextParallelAttentionError(ValueError, HyperParallelError):
    """A model or input the context parallel attention cannot run on; names what to change."""


def balanced_order(length: int, cp: int) -> torch.Tensor:
    """The natural position of each position of the load-balanced sequence: chunks
    c0, c_{2cp-1}, c1, c_{2cp-2}, ... of ``length / (2*cp)`` tokens each."""
    check_balanced_length(length, cp)
    chunks = torch.arange(length).chunk(2 * cp)
    return torch.cat([piece for rank in range(cp) for piece in (chunks[rank], chunks[2 * cp - 1 - rank])])


def check_balanced_length(length: int, cp: int) -> None:
    """Load balance cuts the sequence into 2*cp equal chunks."""
    if length % (2 * cp):
        raise ContextParallelAttentionError(f"sequence length {length} must be divisible by 2*cp_size = {2 * cp} for "
                                            f"accelerator.context_parallel.load_balance (each rank holds two chunks); "
                                            f"change training.seq_len or set load_balance: false")


class SequenceOrder:
    """The load-balanced order of the sequence over ``cp`` ranks: ``permute`` puts a whole
    sequence (dim ``dim``) into it before a split, ``restore`` puts a gathered one back."""

    def __init__(self, cp: int):
        self.cp = cp
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def indices(self, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(order, inverse) for ``length`` on ``device``, made once."""
        key = (length, str(device))
        if key not in self._cache:
            order = balanced_order(length, self.cp)
            self._cache[key] = (order.to(device), torch.argsort(order).to(device))
        return self._cache[key]

    def chunk_order(self) -> list[int]:
        """The natural chunk at each chunk position of the balanced sequence."""
        return [chunk for rank in range(self.cp) for chunk in (rank, 2 * self.cp - 1 - rank)]

    def permute(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        check_balanced_length(tensor.shape[dim], self.cp)
        return _chunks_in_order(tensor, dim, 2 * self.cp, self.chunk_order())

    def restore(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        check_balanced_length(tensor.shape[dim], self.cp)
        inverse = sorted(range(2 * self.cp), key=self.chunk_order().__getitem__)
        return _chunks_in_order(tensor, dim, 2 * self.cp, inverse)

    def local_positions(self, length: int, rank: int, device) -> torch.Tensor:
        """The natural positions of rank ``rank``'s tokens of a ``length``-token sequence."""
        local = length // self.cp
        return self.indices(length, device)[0][rank * local:(rank + 1) * local]


def _chunks_in_order(tensor: torch.Tensor, dim: int, count: int, order: list[int]) -> torch.Tensor:
    """``tensor`` cut along ``dim`` into ``count`` equal chunks, put together in ``order``
    (a copy of contiguous slices: several times faster on CPU than ``index_select`` with
    the positions, which gathers row by row)."""
    size = tensor.shape[dim] // count
    return torch.cat([tensor.narrow(dim, index * size, size) for index in order], dim=dim)


def _all_gather(tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` in rank order (no autograd)."""
    return torch.cat(all_gather_async(tensor, group)(), dim=dim)


class _GatherOverCp(torch.autograd.Function):
    """All-gather along ``dim`` over ``group``; backward sums every rank's gradient of the
    whole and hands each rank its piece."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, dim: int):
        ctx.group, ctx.dim = group, dim
        return _all_gather(tensor, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_async(grad, ctx.group, ctx.dim)(), None, None


def gather_over_cp(tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
    return _GatherOverCp.apply(tensor, group, dim)


class CpAttention:
    """What one attention block's modules need at run time: the cp group, this rank's
    index in it, the load-balanced order (or None) and the inner implementation's name."""

    def __init__(self, group, size: int, rank: int, order: SequenceOrder | None, inner: str,
                 algorithm: str = "allgather_kv"):
        self.group, self.size, self.rank, self.order, self.inner = group, size, rank, order, inner
        self.algorithm = algorithm
        self.calls = 0  # attention calls that gathered K/V (tests read it: the work was split)
        self.query_lengths: set[int] = set()  # the local query lengths seen (tests: S / cp); a set: bounded
        self.mask_free_calls = 0  # of them, by mask-free chunks (``causal_blocks``)
        # (heads, queries) the inner attention computed per call: the work each rank does
        self.inner_shapes: set[tuple[int, int]] = set()

    def chunks(self) -> tuple[int, ...]:
        """The global chunks this rank's tokens are, in their local order."""
        return self.chunks_of(self.rank)

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The global chunks cp rank ``rank``'s tokens are, in their local order (rising):
        r and 2*cp-1-r of 2*cp with load balance, else r of cp."""
        if self.order is not None:
            return (rank, 2 * self.size - 1 - rank)
        return (rank,)

    def local_rows(self, table: torch.Tensor, dim: int) -> torch.Tensor:
        """The rows (along ``dim``) of a per-position tensor made for the whole sequence
        that belong to this rank's tokens, in their local order."""
        count = 2 * self.size if self.order is not None else self.size
        return _chunks_in_order(table, dim, count, list(self.chunks()))

    def local_positions(self, length: int, device) -> torch.Tensor:
        """The natural (global) positions of this rank's tokens of a ``length``-token sequence."""
        if self.order is not None:
            return self.order.local_positions(length, self.rank, device)
        local = length // self.size
        return torch.arange(self.rank * local, (self.rank + 1) * local, device=device)

    def whole_kv(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cp rank's K and V ([batch, kv heads, local tokens, dim]): the whole
        sequence's, in natural order (all-gathered, its adjoint a reduce-scatter)."""
        key, value = gather_over_cp(key, self.group, 2), gather_over_cp(value, self.group, 2)
        if self.order is not None:
            key, value = self.order.restore(key, 2), self.order.restore(value, 2)
        return key, value


def gather_kv(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask, *, sliding_window: int | None = None, additive: bool = False):
    """K and V ([batch, kv heads, local tokens, dim]) gathered over cp in natural order,
    and the mask rows of this rank's queries: (key, value, mask). Without a planned cp
    context on ``module``, everything as given."""
    context: CpAttention | None = getattr(module, CONTEXT_ATTRIBUTE, None)
    if context is None:
        return key, value, attention_mask
    key, value, positions = _gathered(module, context, query, key, value)
    length = key.shape[2]
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise ContextParallelAttentionError(
            f"{type(module).__name__}: attention mask of type {type(attention_mask).__name__}"
            "; allgather_kv takes tensor masks (sdpa, eager)")
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :length]
        if mask.shape[2] != 1:
            mask = mask.index_select(2, positions)
        return key, value, mask
    if not getattr(module, "is_causal", True):
        return key, value, None
    columns = torch.arange(length, device=query.device)
    keep = columns[None, :] <= positions[:, None]
    if sliding_window:
        keep &= positions[:, None] - columns[None, :] < sliding_window
    keep = keep[None, None]
    if additive:
        return key, value, torch.zeros(keep.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~keep, torch.finfo(query.dtype).min)
    return key, value, keep


class KvExchange:
    """The earlier keys' K/V between the cp ranks, without autograd, for the mask-free
    attention (``causal_blocks``). A rank's queries attend, besides their own chunks'
    keys, to every key before its last chunk: ``earlier_async`` gathers exactly those
    (each rank receives from each other only the chunks it reads: at cp2 with load
    balance, rank 1 gets rank 0's first chunk, not its last), and ``local_grads_async``
    is its adjoint: the gradients of those keys go back to the ranks that own them. Each
    only starts the collective and returns the function that waits for it. K and V move
    together, in one collective of rows [tokens, K/V, batch, kv heads, dim] (tokens
    first: a rank's rows for a peer are a prefix of its local tokens, so at two ranks
    what is sent is a view, not a copy)."""

    local = True  # the attention's K/V are this rank's tokens (``causal_blocks``)

    def __init__(self, context: "CpAttention"):
        self.context = context
        self.size, self.rank = context.size, context.rank
        self.chunks = [context.chunks_of(rank) for rank in range(self.size)]
        # the owner rank and local index of each global chunk
        self.owner = {chunk: (rank, index) for rank, chunks in enumerate(self.chunks)
                      for index, chunk in enumerate(chunks)}

    def earlier_chunks(self, rank: int | None = None) -> int:
        """How many chunks (from the sequence's start) ``rank``'s queries read as earlier
        keys: every chunk before its last one."""
        return max(self.chunks[self.rank if rank is None else rank])

    def _read_by(self, owner: int, reader: int) -> int:
        """How many of ``owner``'s chunks ``reader`` reads as earlier keys: a prefix of
        ``owner``'s local tokens (its chunks rise)."""
        return sum(chunk < self.earlier_chunks(reader) for chunk in self.chunks[owner])

    def earlier_async(self, key: torch.Tensor, value: torch.Tensor):
        """Start gathering the K/V ([batch, kv heads, tokens, dim]: this rank's) of the
        keys before this rank's last chunk; the wait hands back (key, value) of those
        keys, contiguous in natural order."""
        size = key.shape[2] // len(self.chunks[self.rank])
        mine = key.new_empty(key.shape[2], 2, key.shape[0], key.shape[1], key.shape[3])  # tokens first
        mine[:, 0], mine[:, 1] = key.permute(2, 0, 1, 3), value.permute(2, 0, 1, 3)
        rows_for = [mine[:self._read_by(self.rank, peer) * size] for peer in range(self.size)]
        receive = [self._read_by(peer, self.rank) * size for peer in range(self.size)]
        received = exchange_rows_async(rows_for, receive, self.context.group)

        def wait() -> tuple[torch.Tensor, torch.Tensor]:
            by_peer = received()
            pieces = []
            for chunk in range(self.earlier_chunks()):
                owner, index = self.owner[chunk]
                rows = mine if owner == self.rank else by_peer[owner]
                pieces.append(rows[index * size:(index + 1) * size].permute(1, 2, 3, 0, 4))
            if not pieces:
                return key[:, :, :0], value[:, :, :0]
            both = torch.cat(pieces, dim=3)  # [K/V, batch, kv heads, keys, dim], contiguous
            return both[0], both[1]

        return wait

    def local_grads_async(self, earlier: torch.Tensor, size: int):
        """Start the adjoint of ``earlier_async``: ``earlier`` holds the gradients of the
        keys before this rank's last chunk, rows [tokens (natural order), K/V, batch, kv
        heads, dim], ``size`` tokens per chunk; the wait hands back what they add to this
        rank's K/V, as (first local row, rows) pairs: this rank's own chunks among them,
        and what each peer sent."""
        rows_for = [None if peer == self.rank else
                    self._rows_of(earlier, self.chunks[peer][:self._read_by(peer, self.rank)], size)
                    for peer in range(self.size)]
        receive = [self._read_by(self.rank, peer) * size for peer in range(self.size)]
        rows_for[self.rank] = earlier[:0]  # the row shape, for a rank that sends nothing
        received = exchange_rows_async(rows_for, receive, self.context.group)
        own = [(index * size, earlier[chunk * size:(chunk + 1) * size])
               for index, chunk in enumerate(self.chunks[self.rank]) if chunk < self.earlier_chunks()]

        def wait() -> list[tuple[int, torch.Tensor]]:
            parts = list(own)
            for peer, rows in enumerate(received()):
                if rows is not None and rows.shape[0]:
                    parts.append((0, rows))  # a prefix of this rank's tokens
            return parts

        return wait

    @staticmethod
    def _rows_of(earlier: torch.Tensor, chunks: tuple[int, ...], size: int) -> torch.Tensor:
        """The rows of ``chunks`` (rising), one tensor: a view where they are consecutive."""
        if not chunks:
            return earlier[:0]
        return consecutive_rows([earlier[chunk * size:(chunk + 1) * size] for chunk in chunks])


def _gathered(module: nn.Module, context: CpAttention, query, key, value):
    """K and V gathered over cp in natural order, and this rank's queries' positions."""
    _check_split(module, context, query, key.shape[2] * context.size)
    key, value = context.whole_kv(key, value)
    return key, value, context.local_positions(key.shape[2], query.device)


def _check_split(module: nn.Module, context: CpAttention, query, length: int) -> None:
    """This rank's queries are its share of a ``length``-token sequence; counts the call
    (the tests read that the work was split)."""
    if context.algorithm != "allgather_kv":
        raise ContextParallelAttentionError(f"{type(module).__name__} gathers K/V (allgather_kv), but the plan's "
                                            f"context_parallel.algorithm is {context.algorithm}")
    positions = context.local_positions(length, query.device)
    if query.shape[2] != positions.numel():
        raise ContextParallelAttentionError(f"{type(module).__name__}: {query.shape[2]} local queries, expected "
                                            f"{positions.numel()} (sequence {length} over cp={context.size})")
    context.calls += 1
    context.query_lengths.add(int(query.shape[2]))
    context.inner_shapes.add((int(query.shape[1]), int(query.shape[2])))


# attention function arguments the mask-free causal path does not do
_SPECIAL_KWARGS = ("softcap", "sliding_window", "s_aux", "sinks")


def causal_without_mask(module: nn.Module, query, key, value, attention_mask, *, dropout: float = 0.0,
                        scaling: float | None = None, **kwargs):
    """sdpa's plain causal case (no mask) on this rank's queries, by mask-free chunks
    (``causal_blocks``): the attention output [batch, local tokens, heads, dim], or None
    where that path does not apply (then the caller gathers K/V with ``gather_kv``)."""
    context: CpAttention | None = getattr(module, CONTEXT_ATTRIBUTE, None)
    if (context is None or attention_mask is not None or not getattr(module, "is_causal", True)
            or not causal_blocks.usable(query, dropout) or any(kwargs.get(k) is not None for k in _SPECIAL_KWARGS)):
        return None
    _check_split(module, context, query, key.shape[2] * context.size)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    context.mask_free_calls += 1
    # K/V gathered inside: only this rank's K/V are kept for backward, which gathers them again
    out = causal_blocks.chunked_causal_attention(query, key, value, context.chunks(), scale,
                                                 exchange=KvExchange(context))
    return out.transpose(1, 2).contiguous()


def _eager_function(module: nn.Module):
    """The model file's own eager attention (softcapping, sinks and such are in it)."""
    function = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if function is None:
        raise ContextParallelAttentionError(f"{type(module).__module__} has no eager_attention_forward for "
                                            f"{type(module).__name__}; run allgather_kv with attn_implementation: sdpa")
    return function


def _all_to_all(tensor: torch.Tensor, group) -> torch.Tensor:
    """Dim 0 (one slice per cp rank) exchanged: slice j goes to rank j; differentiable."""
    from torch.distributed.nn.functional import all_to_all_single

    tensor = tensor.contiguous()
    return all_to_all_single(torch.empty_like(tensor), tensor, group=group)


def _sequence_to_heads(tensor: torch.Tensor, context: CpAttention) -> torch.Tensor:
    """[batch, heads, local tokens, dim] -> [batch, heads / cp (this rank's group), whole
    sequence in natural order, dim]."""
    batch, heads, local, dim = tensor.shape
    cp = context.size
    if heads % cp:
        raise ContextParallelAttentionError(f"ulysses: {heads} local heads do not split over cp={cp}; use "
                                            "accelerator.context_parallel.algorithm: allgather_kv")
    pieces = tensor.reshape(batch, cp, heads // cp, local, dim).transpose(0, 1)
    received = _all_to_all(pieces, context.group)  # [source rank, batch, heads/cp, local, dim]
    whole = received.permute(1, 2, 0, 3, 4).reshape(batch, heads // cp, cp * local, dim)
    return context.order.restore(whole, 2) if context.order is not None else whole


def _heads_to_sequence(output: torch.Tensor, context: CpAttention) -> torch.Tensor:
    """The attention output [batch, whole sequence, heads / cp, dim] back to [batch, local
    tokens, heads, dim], this rank's tokens with every local head."""
    if context.order is not None:
        output = context.order.permute(output, 1)
    batch, length, group, dim = output.shape
    cp = context.size
    pieces = output.reshape(batch, cp, length // cp, group, dim).transpose(0, 1)
    received = _all_to_all(pieces, context.group)  # [head group, batch, local, heads/cp, dim]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, length // cp, cp * group, dim)


class HeadExchange:
    """ulysses' exchanges without autograd, for ``causal_blocks.head_split_attention``:
    ``to_heads`` [batch, heads, local tokens, dim] -> [batch, heads / cp, whole sequence,
    dim], ``to_tokens`` [batch, heads / cp, whole sequence, dim] -> [batch, local tokens,
    heads, dim] (the attention output's layout), and ``heads_of`` the first's inverse."""

    def __init__(self, context: CpAttention):
        self.context = context

    def to_heads(self, tensor: torch.Tensor) -> torch.Tensor:
        return _sequence_to_heads(tensor, self.context)

    def to_tokens(self, tensor: torch.Tensor) -> torch.Tensor:
        return _heads_to_sequence(tensor.transpose(1, 2), self.context)

    def heads_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """[batch, heads / cp, whole sequence, dim] -> [batch, heads, local tokens, dim]."""
        return self.to_tokens(tensor).transpose(1, 2)


def _count_ulysses_call(module: nn.Module, context: CpAttention, query, kwargs) -> None:
    """Refuse what ulysses cannot split; count the call (tests read the split)."""
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ContextParallelAttentionError(
            f"ulysses: {type(module).__name__} has per-head attention sinks, which ulysses "
            "does not split by head group yet; use allgather_kv")
    context.calls += 1
    context.query_lengths.add(int(query.shape[2]))
    context.inner_shapes.add((int(query.shape[1]) // context.size, int(query.shape[2]) * context.size))


def ulysses_without_mask(module: nn.Module, query, key, value, attention_mask, *, dropout: float = 0.0,
                         scaling: float | None = None, **kwargs):
    """sdpa's case without a mask under ulysses, by the flash kernel directly
    (``causal_blocks.head_split_attention``): backward keeps the output in this rank's
    token layout, the very tensor o_proj keeps, not a second copy in the head layout. The
    output [batch, local tokens, heads, dim], or None where that path does not apply."""
    context: CpAttention = getattr(module, CONTEXT_ATTRIBUTE)
    if (attention_mask is not None or not causal_blocks.usable(query, dropout)
            or any(kwargs.get(k) is not None for k in _SPECIAL_KWARGS)):
        return None
    _count_ulysses_call(module, context, query, kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    causal = bool(getattr(module, "is_causal", True)) and query.shape[2] * context.size > 1
    return causal_blocks.head_split_attention(query, key, value, causal, scale, HeadExchange(context))


def ulysses_attention(module: nn.Module, function, query, key, value, attention_mask, **kwargs):
    """``function`` (the inner attention) on this rank's head group over the whole sequence;
    returns (output [batch, local tokens, heads, dim], None)."""
    context: CpAttention = getattr(module, CONTEXT_ATTRIBUTE)
    _count_ulysses_call(module, context, query, kwargs)
    query, key, value = (_sequence_to_heads(t, context) for t in (query, key, value))
    if isinstance(attention_mask, torch.Tensor):
        attention_mask = attention_mask[:, :, :, :key.shape[2]]
    output, _ = function(module, query, key, value, attention_mask, **kwargs)
    return _heads_to_sequence(output, context), None


def inner_attention(module: nn.Module, inner: str):
    """The attention function the wrappers call inside: the model file's own eager one,
    or transformers' sdpa."""
    if inner == "eager":
        return _eager_function(module)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def kv_gathered_attention(module: nn.Module, inner: str, query, key, value, attention_mask, **kwargs):
    """allgather_kv through the mask: K/V gathered (``gather_kv``), the inner attention on
    this rank's queries with the mask rows of their global positions."""
    key, value, attention_mask = gather_kv(module, query, key, value, attention_mask,
                                           sliding_window=kwargs.get("sliding_window"), additive=inner == "eager")
    return inner_attention(module, inner)(module, query, key, value, attention_mask, **kwargs)


def _make_wrapper(inner: str):
    """The attention function registered as ``ATTENTION_NAMES[inner]``."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        context = getattr(module, CONTEXT_ATTRIBUTE, None)
        if context is not None and context.algorithm == "ulysses":
            if inner == "sdpa":
                out = ulysses_without_mask(module, query, key, value, attention_mask, **kwargs)
                if out is not None:
                    return out, None
            return ulysses_attention(module, inner_attention(module, inner), query, key, value, attention_mask,
                                     **kwargs)
        if inner == "sdpa":
            out = causal_without_mask(module, query, key, value, attention_mask, **kwargs)
            if out is not None:
                return out, None
        return kv_gathered_attention(module, inner, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"{ATTENTION_NAMES[inner]}_attention_forward"
    return attention


_registered: set[str] = set()


def register_attention(names: dict[str, str], make) -> None:
    """Register ``make(inner)`` as attention function ``names[inner]`` for each inner
    implementation (sdpa, eager), with the mask function of that implementation (once)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    masks = {"sdpa": sdpa_mask, "eager": eager_mask}
    for inner, name in names.items():
        if name not in _registered:
            AttentionInterface.register(name, make(inner))
            AttentionMaskInterface.register(name, masks[inner])
            _registered.add(name)


def register_attention_functions() -> None:
    """Register the wrappers and their mask functions with transformers (once)."""
    register_attention(ATTENTION_NAMES, _make_wrapper)


def _slice_positions(context: CpAttention):
    """The forward pre-hook of a planned attention block: the rotary (cos, sin) and the
    position ids made for the whole sequence, cut to this rank's tokens."""

    def pre_hook(module, args, kwargs):
        embeddings = kwargs.get("position_embeddings")
        if isinstance(embeddings, (tuple, list)) and embeddings and isinstance(embeddings[0], torch.Tensor):
            kwargs["position_embeddings"] = type(embeddings)(
                context.local_rows(part, part.dim() - 2) if isinstance(part, torch.Tensor) else part
                for part in embeddings)
        ids = kwargs.get("position_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:
            kwargs["position_ids"] = context.local_rows(ids, 1)
        return args, kwargs

    return pre_hook


def install_context_parallel(model: nn.Module, attention_blocks: list[str], device_mesh,
                             order: SequenceOrder | None, *, algorithm: str = "allgather_kv") -> list[CpAttention]:
    """Make the planned attention blocks (``attention_blocks``, FQNs) gather K/V over the
    mesh's cp axis (``algorithm`` allgather_kv) or exchange sequence and heads (ulysses);
    returns their contexts (one per block)."""
    inner = _route_attention(model, attention_blocks, algorithm)
    group = device_mesh.get_group(CP_AXIS)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    contexts = []
    for fqn in attention_blocks:
        block = model.get_submodule(fqn)
        context = CpAttention(group, size, rank, order, inner, algorithm)
        for module in block.modules():
            setattr(module, CONTEXT_ATTRIBUTE, context)
        block.register_forward_pre_hook(_slice_positions(context), with_kwargs=True)
        contexts.append(context)
    logger.info("context parallel: %s on %d attention blocks (cp=%d, inner %s, load balance %s)",
                algorithm, len(contexts), size, inner, order is not None)
    return contexts


def _route_attention(model: nn.Module, attention_blocks: list[str], algorithm: str) -> str:
    """A transformers model's attention function routed through the wrappers: the inner
    implementation's name. A model with no attention implementation in its config
    (``models/common``) computes attention in modules of its own, which must do the cp
    work themselves (class attribute ``OWN_ATTENTION_MARK``): "own"."""
    config = getattr(model, "config", None)
    if not hasattr(config, "_attn_implementation"):
        for fqn in attention_blocks:
            if not any(getattr(type(module), OWN_ATTENTION_MARK, False)
                       for module in model.get_submodule(fqn).modules()):
                raise ContextParallelAttentionError(
                    f"accelerator.context_parallel.algorithm: {algorithm}: {fqn} "
                    f"({type(model.get_submodule(fqn)).__name__}) has no attention module "
                    "that splits its work over cp; set algorithm: gather_sequence")
        return "own"
    current = config._attn_implementation
    inner = next((name for name, wrapper in ATTENTION_NAMES.items() if current in (name, wrapper)), None)
    if inner is None:
        raise ContextParallelAttentionError(
            f"accelerator.context_parallel.algorithm: {algorithm} runs on attention "
            f"implementation sdpa or eager, the model has {current!r}; set "
            f"model.attn_implementation: sdpa (or eager), or algorithm: gather_sequence")
    register_attention_functions()
    config._attn_implementation = ATTENTION_NAMES[inner]
    return inner


def cp_context(module: nn.Module) -> CpAttention | None:
    """The cp context the applier attached to ``module`` (None: no split attention)."""
    return getattr(module, CONTEXT_ATTRIBUTE, None)


