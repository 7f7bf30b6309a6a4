"""Context parallel for recurrent blocks: the state handed on from cp rank to cp rank.

A recurrent block (a gated delta-net, a Mamba2 mixer, a short convolution) reads every
earlier position through its state, so run on one piece of the sequence it needs the state
where the piece starts: the scan's recurrent state and the convolution's last inputs.
transformers' linear-attention layers already take both from their cache when a prompt
arrives in chunks (chunked prefill): ``get_recurrent_state`` gives the scan's initial
state, ``update_conv_state`` returns the chunk with the previous inputs in front, and
``update_recurrent_state`` receives the final state. ``HandOffCache`` is such a cache for
one call of one block, whose earlier chunk is the previous cp rank's piece: what it gives
came from rank r-1, what it receives goes on to rank r+1. We write no scan of our own: the
layer's code runs its chunk from the state it is given.

The hand-off is sequential: rank r runs the block's recurrence once rank r-1 has finished
its piece, so cp does not split that work (it splits the activations, and every other
block). Backward runs the other way: the gradient of a handed state goes back to the rank
that computed it. The pieces must be contiguous, so load balancing (which gives each rank
two pieces from both ends) keeps such blocks gathered.

Transport: point-to-point over the cp group (``Link``) inside two autograd functions,
``_Receive`` (forward: from r-1; backward: the gradients back to r-1) and ``_Send``
(forward: to r+1; backward: their gradients from r+1). ``_Send`` is attached to the block's
output and also carries what was received, with a zero gradient, so every rank sends its
gradients back exactly once whatever the block used of what it got. Messages between two
ranks arrive in the order sent, so the blocks of a layer, and the layers, never mix.
Under activation checkpointing a layer's forward runs again in backward; that recompute
replays what the forward received and sends nothing (``Replays``).

Whether a block follows the protocol is measured at generate time
(``planning/handoff_check.py``): the tiny copy's block, run on pieces each handed the
previous piece's state in process, must give the whole sequence's output and parameter
gradients.
"""

import collections
import inspect
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel.distributed.model_parts import locate_input, positional_names
from hyper_parallel.errors import HyperParallelError

CONV, RECURRENT = 0, 1  # the two kinds of state a linear-attention cache holds
# The names a transformers block's forward takes its cache by (newest first).
CACHE_PARAMETERS = ("cache", "cache_params", "past_key_values")
_MAX_STATES, _MAX_DIMS = 8, 8
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class HandOffError(HyperParallelError):
    """A block that cannot hand its state on as its plan entry says (named, with why)."""


class HandOffCache:
    """The cache one call of a recurrent block gets (module docstring). ``incoming`` gives
    what the previous piece handed on, ``{(kind, state_idx): tensor}``; it is called at the
    block's first need, so a rank waits only when its block asks. ``outgoing`` collects
    what this piece hands on."""

    def __init__(self, incoming: Callable[[], dict]):
        self._incoming, self._received = incoming, None
        self.outgoing: dict[tuple[int, int], torch.Tensor] = {}

    def received(self) -> dict:
        if self._received is None:
            self._received = self._incoming()
        return self._received

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return None  # a piece is never a one-token decode step

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        """A copy, as transformers' cache gives its own buffer: the layer's scan may update
        its initial state in place, which the piece that handed it on still needs."""
        state = self.received().get((RECURRENT, state_idx))
        return None if state is None else state.clone()

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """The piece's convolution input ``[batch, channels, tokens]`` with the previous
        piece's last ``kernel - 1`` inputs in front (zeros on the first piece, the
        convolution's own padding); its own last ones are handed on (reaching back into
        the previous piece's when this one is shorter)."""
        if conv_kernel_size is None:
            raise HandOffError("update_conv_state was called without conv_kernel_size, so the number of earlier "
                               "inputs the convolution reads is unknown")
        halo = self.received().get((CONV, state_idx))
        if halo is None:
            halo = conv_states.new_zeros(*conv_states.shape[:-1], conv_kernel_size - 1)
        full = torch.cat([halo.to(conv_states.dtype), conv_states], dim=-1)
        self.outgoing[(CONV, state_idx)] = full[..., full.shape[-1] - (conv_kernel_size - 1):]
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        self.outgoing[(RECURRENT, state_idx)] = recurrent_states.clone()  # as the cache copies it in
        return recurrent_states

    def __getattr__(self, name: str):
        raise AttributeError(f"the block asked its cache for {name!r}, which a cp state hand-off does not give "
                             "(it gives get/update_conv_state and get/update_recurrent_state)")


def cache_parameter(module: nn.Module) -> str | None:
    """The name the block's forward takes its cache by, or None (no hand-off possible)."""
    try:
        names = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in CACHE_PARAMETERS if name in names), None)


def with_cache(module: nn.Module, name: str, args: tuple, kwargs: dict, cache) -> tuple[tuple, dict]:
    """The call's arguments with ``cache`` as the block's cache, wherever the caller put
    it (by position or by any of its names: a deprecated alias would otherwise win)."""
    args, kwargs = list(args), {key: value for key, value in kwargs.items() if key not in CACHE_PARAMETERS}
    names = positional_names(module)
    if name in names and names.index(name) < len(args):
        args[names.index(name)] = cache
    else:
        kwargs[name] = cache
    return tuple(args), kwargs


def piece_of(value, tokens: int, pieces: int, index: int):
    """Another input of the block cut to its piece when it runs along the whole sequence
    (a padding mask ``[batch, tokens]``, a ``cache_position``); anything else as it is."""
    if not isinstance(value, torch.Tensor) or pieces == 1 or value.dim() == 0:
        return value
    dim = 1 if value.dim() >= 2 else 0
    if value.shape[dim] != tokens * pieces:
        return value
    return value.narrow(dim, index * tokens, tokens)


def first_tensor(output):
    """The block's output that carries the stream (a tensor, or a tuple's first)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _replace_first(output, value):
    """``output`` with its stream tensor replaced (the one ``_Send`` is attached to)."""
    if isinstance(output, torch.Tensor):
        return value
    return type(output)([value, *output[1:]]) if isinstance(output, list) else (value, *output[1:])


# --- transport -------------------------------------------------------------------------


class Link:
    """This rank's neighbours on the cp group, and the messages to and from them: a header
    (how many states, each one's kind, index, dtype and shape), then the states."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    @property
    def has_previous(self) -> bool:
        return self.rank > 0

    @property
    def has_next(self) -> bool:
        return self.rank < self.size - 1

    def send_states(self, keys: list, tensors: list[torch.Tensor], device) -> None:
        header = torch.zeros(1 + _MAX_STATES * (4 + _MAX_DIMS), dtype=torch.int64)
        if len(keys) > _MAX_STATES or any(t.dim() > _MAX_DIMS or t.dtype not in _DTYPES for t in tensors):
            raise HandOffError(f"a cp state hand-off carries at most {_MAX_STATES} states of at most {_MAX_DIMS} "
                               f"dims in {_DTYPES}; got {[(k, tuple(t.shape), t.dtype) for k, t in zip(keys, tensors)]}")
        header[0] = len(keys)
        for slot, ((kind, index), tensor) in enumerate(zip(keys, tensors)):
            row = [kind, index, _DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
            start = 1 + slot * (4 + _MAX_DIMS)
            header[start:start + len(row)] = torch.tensor(row)
        dist.send(header.to(device), group=self.group, group_dst=self.rank + 1)
        for tensor in tensors:
            dist.send(tensor.detach().contiguous(), group=self.group, group_dst=self.rank + 1)

    def receive_header(self, device) -> list[tuple[tuple[int, int], torch.dtype, tuple[int, ...]]]:
        header = torch.zeros(1 + _MAX_STATES * (4 + _MAX_DIMS), dtype=torch.int64, device=device)
        dist.recv(header, group=self.group, group_src=self.rank - 1)
        values = header.tolist()
        specs = []
        for slot in range(values[0]):
            kind, index, dtype, ndim, *dims = values[1 + slot * (4 + _MAX_DIMS):1 + (slot + 1) * (4 + _MAX_DIMS)]
            specs.append(((kind, index), _DTYPES[dtype], tuple(dims[:ndim])))
        return specs

    def receive(self, specs, device) -> list[torch.Tensor]:
        tensors = []
        for _, dtype, shape in specs:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(tensor, group=self.group, group_src=self.rank - 1)
            tensors.append(tensor)
        return tensors

    def send_back(self, grads: list[torch.Tensor]) -> None:
        for grad in grads:
            dist.send(grad.contiguous(), group=self.group, group_dst=self.rank - 1)

    def receive_back(self, specs: list) -> list[torch.Tensor]:
        """The gradients of the states sent forward (``specs``: their shape, dtype, device)."""
        grads = []
        for shape, dtype, device in specs:
            grad = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(grad, group=self.group, group_src=self.rank + 1)
            grads.append(grad)
        return grads


class _Receive(torch.autograd.Function):
    """The previous rank's states (forward); their gradients back to it (backward)."""

    @staticmethod
    def forward(ctx, link: Link, specs, device, anchor):
        ctx.link = link
        return tuple(link.receive(specs, device))

    @staticmethod
    def backward(ctx, *grads):
        ctx.link.send_back(list(grads))
        return None, None, None, None


class _Send(torch.autograd.Function):
    """This rank's states on to the next rank (forward); their gradients from it
    (backward). Attached to the block's output, with what the block received."""

    @staticmethod
    def forward(ctx, link: Link, replay: "_Forward | None", keys: list, count: int, output, *tensors):
        sent = tensors[:count]
        if link.has_next:
            link.send_states(keys, list(sent), output.device)
        ctx.link, ctx.replay = link, replay
        ctx.specs = [(t.shape, t.dtype, t.device) for t in tensors]
        ctx.count = count
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        sent, received = ctx.specs[:ctx.count], ctx.specs[ctx.count:]
        grads = ctx.link.receive_back(sent) if ctx.link.has_next else [_zeros(spec) for spec in sent]
        return None, None, None, None, grad_output, *grads, *[_zeros(spec) for spec in received]


def _zeros(spec) -> torch.Tensor:
    """The zero gradient of a state no neighbour answers for (the last rank's sends)."""
    shape, dtype, device = spec
    return torch.zeros(shape, dtype=dtype, device=device)


def install_state_handoff(module: nn.Module, group, *, stream_index: int, where: str) -> None:
    """Run ``module`` on this rank's piece with its state handed on over ``group`` (the cp
    group): registered after the entry's input conversions (its inputs are local pieces)
    and before its output conversions."""
    name = cache_parameter(module)
    if name is None:
        raise HandOffError(f"{where}: the plan hands its state on over cp, but {type(module).__name__}.forward "
                           f"takes no cache ({', '.join(CACHE_PARAMETERS)}); regenerate the bundle")
    link = Link(group)
    arg_names = positional_names(module)
    replays = Replays(where)
    calls: list[tuple[HandOffCache, list | None, "_Forward | None"]] = []

    def pre_hook(mod, args, kwargs):
        holder, key = locate_input(stream_index, list(args), dict(kwargs), arg_names)
        stream = None if holder is None else holder[key]
        if not isinstance(stream, torch.Tensor) or stream.dim() < 2:
            raise HandOffError(f"{where}: input {stream_index} (the stream split over cp) is not a "
                               f"[batch, tokens, ...] tensor")
        if recomputing():
            forward = replays.take()
            cache, received = HandOffCache(lambda: forward.replayed_inputs()), None
        else:
            received, forward = [], replays.record() if torch.is_grad_enabled() else None
            cache = HandOffCache(lambda: _incoming(link, stream.device, received, forward))
        args, kwargs = with_cache(mod, name, args, kwargs, cache)
        tokens = stream.shape[1]
        args = tuple(value if value is stream else piece_of(value, tokens, link.size, link.rank) for value in args)
        kwargs = {k: value if value is stream else piece_of(value, tokens, link.size, link.rank)
                  for k, value in kwargs.items()}
        calls.append((cache, received, forward))
        return args, kwargs

    def post_hook(mod, args, kwargs, output):
        cache, received, forward = calls.pop()
        if received is None:
            return None  # a recompute: what it computes only refills saved tensors; nothing is sent
        if link.has_previous:
            cache.received()  # a block that asked for nothing still takes (and answers) the message
        first = first_tensor(output)
        if first is None:
            raise HandOffError(f"{where}: the block returned no tensor to carry its handed-on state")
        keys = sorted(cache.outgoing)
        attached = _Send.apply(link, forward, keys, len(keys), first,
                               *[cache.outgoing[k] for k in keys], *received)
        return _replace_first(output, attached)

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    module.register_forward_hook(post_hook, with_kwargs=True, prepend=True)


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass: activation checkpointing's
    recompute (torch.utils.checkpoint, non-reentrant), which must not send or wait again."""
    return torch._C._current_graph_task_id() != -1


class _Forward:
    """One forward of a block with gradients: what it received, for a recompute. Held by
    the forward's ``_Send`` node, so it lives as long as that forward's graph."""

    def __init__(self):
        self.received: dict = {}
        self.replayed = False

    def replayed_inputs(self) -> dict:
        """The received values as the recompute's inputs: requiring gradients as they did in
        the forward, so its ops save the same tensors (checkpoint compares them)."""
        return {key: value.detach().requires_grad_(value.is_floating_point()) for key, value in self.received.items()}


class Replays:
    """The forwards of one block a recompute may still ask for, oldest first. Under
    activation checkpointing a decoder layer's forward runs again during its backward,
    while the neighbours wait on this rank's gradients: the recompute takes what its
    forward received instead of waiting for a message no one sends again. Recomputes come
    in the order of the forwards (a pipeline's microbatches too), one per forward; a
    forward's entry goes when its graph does (weakly held here), so without checkpointing
    nothing accumulates."""

    def __init__(self, where: str):
        self.where, self.forwards = where, collections.deque()

    def record(self) -> _Forward:
        while self.forwards and self.forwards[0]() is None:
            self.forwards.popleft()
        forward = _Forward()
        self.forwards.append(weakref.ref(forward))
        return forward

    def take(self) -> _Forward:
        for ref in self.forwards:
            forward = ref()
            if forward is not None and not forward.replayed:
                forward.replayed = True
                return forward
        raise HandOffError(f"{self.where}: recomputed in backward (activation checkpointing), but no forward of it "
                           "is waiting for its backward; the hand-off cannot replay what it received")


def _incoming(link: Link, device, received: list, forward: "_Forward | None") -> dict:
    """What the previous rank handed on (nothing on the first rank), through ``_Receive``
    so its gradient goes back; ``received`` keeps the tensors for ``_Send`` to carry, and
    ``forward`` their values for a recompute."""
    if not link.has_previous:
        return {}
    specs = link.receive_header(device)
    if not specs:
        return {}
    anchor = torch.zeros((), device=device, requires_grad=torch.is_grad_enabled())
    tensors = _Receive.apply(link, specs, device, anchor)
    received.extend(tensors)
    got = {key: tensor for (key, _, _), tensor in zip(specs, tensors)}
    if forward is not None:
        forward.received = {key: tensor.detach() for key, tensor in got.items()}
    return got
