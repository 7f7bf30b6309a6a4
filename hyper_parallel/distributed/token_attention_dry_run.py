"""A dry run of an attention block keeping each cp rank's tokens, on the traced copy.

Under ``allgather_kv`` (and ``ulysses``) an attention block runs on the rank's own tokens:
its rotary embeddings are cut to them, its attention function sees the whole sequence's
K/V and the mask rows of the rank's queries (``context_parallel``). That is exact when the
block's own code is per-token around the attention function. A block that does more with
the whole sequence is not: an indexer choosing keys by a mask it builds over the tokens it
was handed (Qwen4-Exp's sparse attention), code that cuts the positions to the hidden
states' length itself, a mask combined with something made on the piece. The static
checks of ``sequence_layout`` cannot see that.

So each candidate block of the tiny copy runs once as rank 1 of 2 would, load-balanced
(chunks 1 and 2 of 4): its captured inputs with the stream cut to the rank's tokens, the
positions cut by the applier's own pre-hook, and an attention function doing what
``kv_gathered_attention`` does with the K/V the same block computed on the whole sequence
in place of the all-gather. Its output must equal the whole-sequence output's rows of
those tokens; an error or a difference is the block's refusal, and the planner gathers the
block (the default algorithm) or refuses the recipe (an algorithm the recipe named).
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
from hyper_parallel.distributed.sequence_dry_run import perturbed, Unusable

_RANKS, _RANK = 2, 1  # the rank rehearsed: load-balanced, it holds two chunks from the middle
_REHEARSAL_NAMES = {inner: f"hyper_cp_dry_run_{inner}" for inner in ATTENTION_NAMES}
_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


class _Rehearsal(CpAttention):
    """The cp context of the rehearsed rank: ``whole_kv`` hands back what the block's
    whole-sequence call recorded (``recording``), call by call, instead of gathering."""

    def __init__(self, inner: str):
        super().__init__(None, _RANKS, _RANK, SequenceOrder(_RANKS), inner)
        self.recording = True
        self.recorded: list[tuple[torch.Tensor, torch.Tensor]] = []

    def whole_kv(self, key, value):
        if not self.recorded:
            raise RuntimeError("the block calls its attention more often on a piece of the sequence than on the whole")
        whole_key, whole_value = self.recorded.pop(0)
        if whole_key.shape[2] != key.shape[2] * self.size:
            raise RuntimeError(f"its attention got {key.shape[2]} keys on a piece of {self.size}, "
                               f"{whole_key.shape[2]} on the whole sequence")
        return whole_key, whole_value


def _rehearsal_function(inner: str):
    """The attention function of the dry run: records K/V on the whole sequence, then
    attends as allgather_kv does (its mask path) on the piece."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        context = getattr(module, CONTEXT_ATTRIBUTE, None)
        if context is None or context.recording:
            if context is not None:
                context.recorded.append((key, value))
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
    """'' when ``block`` on the rehearsed rank's tokens gives the rows of ``whole_output``."""
    context = _Rehearsal(inner)
    configs = {id(m.config): m.config for m in block.modules() if hasattr(getattr(m, "config", None),
                                                                          "_attn_implementation")}
    saved = {key: config._attn_implementation for key, config in configs.items()}
    modules = list(block.modules())
    hook = block.register_forward_pre_hook(_slice_positions(context), with_kwargs=True)
    try:
        for config in configs.values():
            config._attn_implementation = _REHEARSAL_NAMES[inner]
        for module in modules:
            setattr(module, CONTEXT_ATTRIBUTE, context)
        hook.remove()  # the whole-sequence call records K/V with the positions as they are
        with torch.no_grad():
            _first(block(*args, **kwargs))
            context.recording = False
            hook = block.register_forward_pre_hook(_slice_positions(context), with_kwargs=True)
            piece_args, piece_kwargs = list(args), dict(kwargs)
            where, key = locate_input(stream_index, piece_args, piece_kwargs, positional_names(block))
            if where is None or not isinstance(where[key], torch.Tensor) or where[key].dim() < 2:
                return "its stream input could not be found in the traced call"
            where[key] = context.local_rows(where[key], 1)
            output = _first(block(*piece_args, **piece_kwargs))
        expected = context.local_rows(whole_output, 1)
        if output.shape != expected.shape:
            return f"on its tokens it returns shape {list(output.shape)}, expected {list(expected.shape)}"
        if not torch.allclose(output, expected, **_TOLERANCE):
            error = (output - expected).abs().max().item()
            return (f"on its tokens (whole-sequence K/V in its attention) its output differs from the whole "
                    f"sequence's by up to {error:.1e}: its code uses the sequence beyond the attention function")
        return ""
    except Exception as exc:  # the block's own code on a piece: its error is the reason
        return f"on its tokens it fails: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    finally:
        hook.remove()
        for module in modules:
            module.__dict__.pop(CONTEXT_ATTRIBUTE, None)
        for key, config in configs.items():
            config._attn_implementation = saved[key]


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
