"""A dry run of an attention block keeping each cp rank's tokens, on the traced copy.

Under ``allgather_kv`` (and ``ulysses``) an attention block runs on the rank's own tokens:
its rotary embeddings are cut to them, its attention function sees the whole sequence's
K/V and the mask rows of the rank's queries (``context_parallel``). That is exact when the
block's own code is per-token around the attention function. A block that does more with
the whole sequence is not: an indexer choosing keys by a mask it builds over the tokens it
was handed (Qwen4-Exp's sparse attention), code that cuts the positions to the hidden
states' length itself, a mask combined with something made on the piece. The static
checks of ``sequence_layout`` cannot see that.

So each candidate block of the tiny copy runs as each of 2 load-balanced cp ranks would
(rank 0: chunks 0 and 3 of 4, rank 1: chunks 1 and 2): its captured inputs with the stream
cut to the rank's tokens, the positions cut by the applier's own pre-hook, and an
attention function doing what ``kv_gathered_attention`` does. Its K/V are what the
all-gather would give: both ranks' own K/V of that call put together in sequence order,
so a value or key path that reads beyond the rank's tokens (ZAYA's delayed value, a
convolution over the sequence) shows, as it would in training. A block calling attention
more than once is run once more per call, each pass with the K/V of the calls before it.
Each rank's output must equal the whole-sequence output's rows of its tokens; an error or
a difference is the block's refusal, and the planner gathers the block (the default
algorithm) or refuses the recipe (an algorithm the recipe named).
"""

import torch
from torch import nn

from hyper_parallel.distributed.context_parallel import (
    ATTENTION_NAMES,
    CONTEXT_ATTRIBUTE,
    CpAttention,
    SequenceOrder,
    _slice_positions,
    inner_attention,
    kv_gathered_attention,
    register_attention,
)
from hyper_parallel.distributed.model_parts import locate_input, positional_names
from hyper_parallel.planning.sequence_dry_run import perturbed, Unusable

_RANKS = 2  # the ranks rehearsed, load-balanced: rank 0 holds the sequence's ends, rank 1 its middle
_REHEARSAL_NAMES = {inner: f"hyper_cp_dry_run_{inner}" for inner in ATTENTION_NAMES}
_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


_MAX_CALLS = 8  # attention calls per block the rehearsal follows (a block calls it once or twice)


class _Rehearsal(CpAttention):
    """The cp context of one rehearsed rank: ``whole_kv`` records the rank's own K/V call by
    call and hands back the gathered K/V ``known`` from the previous pass (``_rehearse``);
    for the first call not known yet, a stand-in of the gathered shape (that pass's output
    is not compared)."""

    def __init__(self, inner: str, rank: int, known: list[tuple[torch.Tensor, torch.Tensor]]):
        super().__init__(None, _RANKS, rank, SequenceOrder(_RANKS), inner)
        self.known = known
        self.own: list[tuple[torch.Tensor, torch.Tensor]] = []

    def whole_kv(self, key, value):
        index = len(self.own)
        self.own.append((key, value))
        if index < len(self.known):
            whole_key, whole_value = self.known[index]
            if whole_key.shape[2] != key.shape[2] * self.size:
                raise RuntimeError(f"its attention got {key.shape[2]} keys on one rank's tokens, "
                                   f"{whole_key.shape[2]} gathered")
            return whole_key, whole_value
        return torch.cat([key] * self.size, dim=2), torch.cat([value] * self.size, dim=2)


def _all_gathered(own: dict[int, list], index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Call ``index``'s K/V as the all-gather hands them on: the ranks' own, in rank order,
    put back into sequence order."""
    order = SequenceOrder(_RANKS)
    return tuple(order.restore(torch.cat([own[rank][index][part] for rank in range(_RANKS)], dim=2), 2)
                 for part in (0, 1))


def _rehearsal_function(inner: str):
    """The attention function of the dry run: as allgather_kv attends (its mask path), with
    the rehearsal's K/V; the block's plain implementation outside a rehearsal."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        if getattr(module, CONTEXT_ATTRIBUTE, None) is None:
            return inner_attention(module, inner)(module, query, key, value, attention_mask, **kwargs)
        return kv_gathered_attention(module, inner, query, key, value, attention_mask, **kwargs)

    return attention


def _refusals(model: nn.Module, input_ids: torch.Tensor, candidates: list[str],
              stream_inputs: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """``token_attention_refusals`` on the copy as it is. Blocks of a model whose attention
    implementation the wrappers do not run are left to the static checks."""
    inner = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if inner not in ATTENTION_NAMES or input_ids.shape[1] % (2 * _RANKS):
        return {}
    register_attention(_REHEARSAL_NAMES, _rehearsal_function)
    captured: dict[str, tuple[tuple, dict, torch.Tensor]] = {}

    def capture(name):
        def hook(module, args, kwargs, output):
            first = output[0] if isinstance(output, (tuple, list)) else output
            if name not in captured and isinstance(first, torch.Tensor):
                captured[name] = (tuple(args), _without_cache(kwargs), first.detach())
        return hook

    handles = [model.get_submodule(name).register_forward_hook(capture(name), with_kwargs=True)
               for name in candidates]
    try:
        with torch.no_grad():
            logits = getattr(model(input_ids=input_ids), "logits", None)
        if isinstance(logits, torch.Tensor) and not torch.isfinite(logits).all():
            raise Unusable("non-finite logits")
    except Exception as exc:
        raise Unusable(f"{type(exc).__name__}: {exc}") from exc
    finally:
        for handle in handles:
            handle.remove()
    refused = {}
    for name in candidates:
        if name in captured:
            why = _rehearse(model.get_submodule(name), *captured[name], inner,
                            (stream_inputs.get(name) or (0,))[0])
            if why:
                refused[name] = why
    return refused


def token_attention_refusals(model: nn.Module, input_ids: torch.Tensor, candidates: list[str],
                             stream_inputs: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """{candidate attention block: why it cannot keep each cp rank's tokens}, measured on
    the tiny copy (module docstring) with a little noise on its weights, as the sequence
    dry run does: a path starting at zero (a delayed value projection behind a zero gate)
    mixes tokens once training moves it. Blocks that pass are absent."""
    try:
        with perturbed(model):
            return _refusals(model, input_ids, candidates, stream_inputs)
    except Unusable:  # the perturbed copy does not run: its own weights
        try:
            return _refusals(model, input_ids, candidates, stream_inputs)
        except Unusable as exc:  # nothing checked is nothing claimed
            return {name: f"the tiny copy did not run for the dry run: {exc}" for name in candidates}


def _rehearse(block: nn.Module, args: tuple, kwargs: dict, whole_output: torch.Tensor, inner: str,
              stream_index: int) -> str:
    """'' when ``block`` on each rehearsed rank's tokens, with K/V gathered from the ranks'
    own, gives that rank's rows of ``whole_output``; else why not."""
    configs = {id(m.config): m.config for m in block.modules() if hasattr(getattr(m, "config", None),
                                                                          "_attn_implementation")}
    saved = {key: config._attn_implementation for key, config in configs.items()}
    where, key = locate_input(stream_index, list(args), dict(kwargs), positional_names(block))
    if where is None or not isinstance(where[key], torch.Tensor) or where[key].dim() < 2:
        return "its stream input could not be found in the traced call"
    try:
        for config in configs.values():
            config._attn_implementation = _REHEARSAL_NAMES[inner]
        known: list[tuple[torch.Tensor, torch.Tensor]] = []
        while True:
            contexts = [_Rehearsal(inner, rank, known) for rank in range(_RANKS)]
            outputs = [_run_as(block, context, args, kwargs, stream_index) for context in contexts]
            calls = {len(context.own) for context in contexts}
            if len(calls) > 1:
                return f"its ranks call attention a different number of times on their tokens ({sorted(calls)})"
            if calls.pop() <= len(known):
                break
            if len(known) == _MAX_CALLS:
                return f"it calls attention more than {_MAX_CALLS} times"
            known.append(_all_gathered({context.rank: context.own for context in contexts}, len(known)))
        for context, output in zip(contexts, outputs):
            expected = context.local_rows(whole_output, 1)
            if output.shape != expected.shape:
                return f"on its tokens it returns shape {list(output.shape)}, expected {list(expected.shape)}"
            if not torch.allclose(output, expected, **_TOLERANCE):
                error = (output - expected).abs().max().item()
                return (f"on cp rank {context.rank}'s tokens (K/V gathered from the ranks') its output differs "
                        f"from the whole sequence's by up to {error:.1e}: its code uses the sequence beyond "
                        f"the attention function")
        return ""
    except Exception as exc:  # the block's own code on a piece: its error is the reason
        return f"on its tokens it fails: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    finally:
        for key, config in configs.items():
            config._attn_implementation = saved[key]


def _run_as(block: nn.Module, context: _Rehearsal, args: tuple, kwargs: dict, stream_index: int) -> torch.Tensor:
    """``block``'s stream output on ``context``'s rank: its stream input cut to the rank's
    tokens, its positions cut by the applier's pre-hook, its modules holding the context."""
    modules = list(block.modules())
    piece_args, piece_kwargs = list(args), dict(kwargs)
    where, key = locate_input(stream_index, piece_args, piece_kwargs, positional_names(block))
    where[key] = context.local_rows(where[key], 1)
    hook = block.register_forward_pre_hook(_slice_positions(context), with_kwargs=True)
    try:
        for module in modules:
            setattr(module, CONTEXT_ATTRIBUTE, context)
        with torch.no_grad():
            return _first(block(*piece_args, **piece_kwargs))
    finally:
        hook.remove()
        for module in modules:
            module.__dict__.pop(CONTEXT_ATTRIBUTE, None)


def _without_cache(kwargs: dict) -> dict:
    """The call's keywords with no KV cache: the traced forward's cache already holds the
    whole sequence's keys, which each rehearsed call would append to."""
    from transformers.cache_utils import Cache

    return {key: None if isinstance(value, Cache) else value for key, value in kwargs.items()}


def _first(output):
    """A block's stream output (the first of a tuple)."""
    first = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(first, torch.Tensor):
        raise RuntimeError(f"it returns {type(first).__name__}, not a tensor")
    return first
