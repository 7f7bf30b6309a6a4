"""The generate-time check of the cp state hand-off: does a recurrent block follow it?

Context parallel hands a recurrent block's state from cp rank to cp rank through the
block's own cache protocol (``distributed/state_handoff.py``, which runs in training).
Whether a given block's code takes that hand-off is not assumed but measured once, at
generate time, on the tiny traced copy: the block, run on pieces of its input each handed
the previous piece's state in process, must give the whole sequence's output and
parameter gradients. A block that does not is planned gathered over cp, with the reason.
"""

from collections.abc import Callable

import torch
from torch import nn

from hyper_parallel.distributed.model_parts import decoder_layers, locate_input, positional_names
from hyper_parallel.distributed.state_handoff import (
    CACHE_PARAMETERS,
    HandOffCache,
    HandOffError,
    cache_parameter,
    first_tensor,
    piece_of,
    with_cache,
)


def handoff_blocks(model: nn.Module, input_ids: torch.Tensor, candidates: list[str],
                   stream_inputs: dict[str, tuple[int, ...]]) -> tuple[frozenset[str], dict[str, str]]:
    """Which of the ``candidates`` (recurrent blocks of the decoder layers) hand their
    state on exactly, measured on the tiny copy: (those that do, {the others: why not})."""
    captured: dict[str, tuple[tuple, dict]] = {}

    def capture(name):
        def hook(module, args, kwargs):
            captured.setdefault(name, (tuple(_detached(a) for a in args),
                                       {k: _detached(v) for k, v in kwargs.items()}))
        return hook

    handles = [model.get_submodule(name).register_forward_pre_hook(capture(name), with_kwargs=True)
               for name in candidates]
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for handle in handles:
            handle.remove()
    passed, refused = set(), {}
    for name in candidates:
        if name not in captured:
            refused[name] = "it did not run in the traced forward"
            continue
        args, kwargs = captured[name]
        why = handoff_check(model.get_submodule(name), args, kwargs, (stream_inputs.get(name) or (0,))[0])
        if why:
            refused[name] = why
        else:
            passed.add(name)
    return frozenset(passed), refused


def _detached(value):
    """A captured input without the traced forward's graph."""
    return value.detach() if isinstance(value, torch.Tensor) else value


def handoff_check(block: nn.Module, args: tuple, kwargs: dict, stream_index: int) -> str:
    """"" when ``block`` run on pieces of its input, each with a ``HandOffCache`` handed
    the previous piece's states, gives the whole input's output and parameter gradients;
    else why not."""
    name = cache_parameter(block)
    if name is None:
        return f"its forward takes no cache ({', '.join(CACHE_PARAMETERS)})"
    holder, key = locate_input(stream_index, list(args), dict(kwargs), positional_names(block))
    stream = None if holder is None else holder[key]
    if not isinstance(stream, torch.Tensor) or stream.dim() < 2:
        return f"its input {stream_index} is not a [batch, tokens, ...] tensor"
    length = stream.shape[1]
    pieces = next((n for n in (4, 2) if length % n == 0 and length // n >= 1), 0)
    if not pieces:
        return f"the traced sequence of {length} tokens does not split into pieces"
    try:  # the whole sequence without a cache (a traced forward may have passed a filled one)
        whole, whole_grads = _run(block, args, kwargs, name, None)
    except Exception as exc:
        return f"run on the whole sequence, it raised {type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
    try:
        outputs, handed = [], {}
        tokens = length // pieces
        for index in range(pieces):
            piece = stream.narrow(1, index * tokens, tokens)
            piece_args = tuple(piece if a is stream else piece_of(a, tokens, pieces, index) for a in args)
            piece_kwargs = {k: piece if v is stream else piece_of(v, tokens, pieces, index) for k, v in kwargs.items()}
            cache = HandOffCache(lambda given=handed: given)
            out, _ = _run(block, piece_args, piece_kwargs, name, cache, collect=False)
            outputs.append(out)
            handed = cache.outgoing
        grads = _grads(block, torch.cat(outputs, dim=1))
    except Exception as exc:  # the block's code does not take the hand-off: gathered instead, with why
        return f"run on pieces with the state handed on, it raised {type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
    return _compare(whole, whole_grads, torch.cat(outputs, dim=1), grads)


def _run(block: nn.Module, args: tuple, kwargs: dict, name: str, cache, *, collect: bool = True):
    """The block's first output (with its graph) with ``cache`` (None: none) as its cache
    and, with ``collect``, the parameter gradients of a fixed projection of it."""
    args, kwargs = with_cache(block, name, args, kwargs, cache)
    block.zero_grad(set_to_none=True)
    with torch.enable_grad():
        out = first_tensor(block(*args, **kwargs))
    if out is None:
        raise HandOffError("the block returned no tensor")
    return out, (_grads(block, out) if collect else None)


def _grads(block: nn.Module, out: torch.Tensor) -> dict[str, torch.Tensor]:
    block.zero_grad(set_to_none=True)
    weights = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * weights).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in block.named_parameters() if p.grad is not None}
    block.zero_grad(set_to_none=True)
    return grads


def _compare(whole: torch.Tensor, whole_grads: dict, pieces: torch.Tensor, grads: dict) -> str:
    def far(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape != b.shape or bool((a - b).abs().max() > 1e-4 * (1 + b.abs().max()))

    if far(pieces.detach(), whole.detach()):
        return ("run on pieces with the state handed on, its output differs from the whole sequence's "
                "(its code does not take the earlier state through its cache)")
    wrong = sorted(name for name in whole_grads if name not in grads or far(grads[name], whole_grads[name]))
    if wrong:
        return f"run on pieces with the state handed on, the gradients of {', '.join(wrong[:3])} differ"
    return ""


def recurrent_candidates(model: nn.Module, is_candidate: Callable[[str, nn.Module], bool]) -> list[str]:
    """The decoder layers' children ``is_candidate`` picks, in model order."""
    found = decoder_layers(model)
    if found is None:
        return []
    layers_fqn, layers = found
    return [f"{layers_fqn}.{index}.{name}" for index, layer in enumerate(layers)
            for name, child in layer.named_children() if is_candidate(f"{layers_fqn}.{index}.{name}", child)]
