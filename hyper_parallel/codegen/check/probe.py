"""The verify stage's probe: the recipe's model config shrunk so that the generated model
runs in seconds on a CPU, keeping every property the frozen plan depends on.

The rules (docs/guide/codegen.md, "What verify proves") are:

- heads: kv heads become ``max(tp, 2)`` when they divide by it (else they stay as they are); query
  heads keep their ratio to kv heads; ``head_dim`` is kept as is;
- widths: ``hidden_size`` 64 (or heads x head_dim where the config derives head_dim from
  it), intermediate sizes 32, vocabulary 256 — each rounded up to a multiple of ``tp``;
- experts: at least 2 per ep rank and at least top-k, a multiple of ``ep`` (and of the
  router's group count); top-k is kept;
- depth: the shortest prefix of the layers that holds every distinct layer kind the full
  model has (a kind = the layer's module types and parameter shapes, and its attention
  type: sliding vs full, dense vs sparse MLP, shared experts...); per-layer lists in the
  config (``layer_types``) are cut to that prefix;
- sliding windows shrink below the probe's sequence, so the window is exercised;
- every dropout probability is 0: the probe runs in training mode, and ranks draw other
  random masks than one process does, so dropout would make a right plan mismatch.

Everything else (biases, tied embeddings, norms, rotary settings, activation) is the
recipe's. A config that cannot be shrunk this way is refused, naming the config key.
"""

import copy
import math
import re
from dataclasses import dataclass
from typing import Any

from hyper_parallel.hf_config_keys import (
    EXPERT_COUNT_KEYS,
    EXPERT_GROUP_KEYS,
    TOP_GROUP_KEYS,
    TOP_K_KEYS,
    layer_overrides,
)
from hyper_parallel.errors import HyperParallelError

HIDDEN = 64
INTERMEDIATE = 32
VOCAB = 256
INTERMEDIATE_KEYS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "ffn_hidden_size", "expert_intermediate_size")
# Other widths that equal hidden_size in the model follow it in the probe: a projection
# between two of them exists only when they differ (OPT's word_embed_proj_dim:
# project_in/project_out), so a probe with the one shrunk and not the other would have
# modules the model lacks. Named like a width; per-head and other inner sizes excluded.
FOLLOWS_HIDDEN_KEY = re.compile(r"(_dim|_size)$")
NOT_HIDDEN_WIDTH = re.compile(r"head|intermediate|vocab|window|position|chunk|batch|rank|expert|kernel|conv|state")
TOKEN_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id")
# Attributes of a layer's modules that make two layers of equal structure different kinds.
KIND_ATTRIBUTES = ("sliding_window", "is_sliding", "attention_type", "use_sliding_window", "is_causal")
# Config attributes that are dropout probabilities: "dropout" anywhere (attention_dropout,
# hidden_dropout_prob), or ending like GPT-2's resid_pdrop, LayerDrop's layerdrop, drop_rate.
PER_LAYER_KEY = re.compile(r"layer|block|pattern|_types?$")  # a list named per layer
DEPTH_ALIAS_KEY = re.compile(r"(num_|n_)(hidden_)?(blocks|layers)")  # another count of the decoder layers
LAYER_INDEX_KEY = re.compile(r"(_ids|_idxs|_indices|_index)$")  # layer numbers, not one entry per layer
DROPOUT_KEY = re.compile(r"dropout|pdrop$|layerdrop$|drop_(path_)?rate$")


class ProbeError(ValueError, HyperParallelError):
    """The model config cannot be shrunk faithfully; names the config key."""


@dataclass(frozen=True)
class ProbeShape:
    """How the probe is run: ``microbatches`` sequences of ``seq_len`` tokens per
    data-parallel rank (one each, but one per pipeline stage under pp)."""

    seq_len: int
    batch: int
    microbatches: int = 1


def probe_shape(dp: int, cp: int, tp: int, stages: int = 1) -> ProbeShape:
    """The sequence splits evenly over cp (in 2*cp load-balancing chunks) and tp (sequence
    parallel): 4*cp*tp tokens, at least 8. Under pipeline parallel each dp rank runs as many
    micro-batches as there are stages, so every schedule fills its pipeline and a micro-batch
    loss scaled wrong shows."""
    return ProbeShape(seq_len=max(8, 4 * cp * tp), batch=dp * stages, microbatches=stages)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _first_key(config: Any, keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if isinstance(getattr(config, k, None), int)
                 and not isinstance(getattr(config, k), bool)), None)


def shrink_widths(config: Any, *, tp: int, ep: int, seq_len: int, where: str) -> Any:
    """A copy of ``config`` with the probe's widths (full depth); see the module docstring.

    Every dropout probability of the copy is 0 (``zero_dropout``): verify compares
    training-mode steps of the bundle at the recipe's world size with one process, and
    dropout draws different random masks there, so the runs would differ by their masks
    however right the plan is. Verify checks the plan, not dropout."""
    overrides = layer_overrides(config)
    if overrides is not None:  # read (and set) the model-wide values; the layers' own follow below
        config = copy.deepcopy(config)
        config.allow_global_per_layer_attribute_access = True
    probe = copy.deepcopy(config)
    values: dict[str, Any] = {}
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None)
    if heads is None and not _has_attention_heads(config):
        pass  # no attention (a state-space model): its widths are kept, only its depth is cut
    elif isinstance(head_dim, int) and head_dim > 0:
        values.update(_probe_heads(config, tp, where))
        values["hidden_size"] = _round_up(HIDDEN, tp)
    else:  # head_dim derives from hidden_size / heads: keep the original head width
        values.update(_probe_heads(config, tp, where))
        if config.hidden_size % heads:
            raise ProbeError(f"{where}: hidden_size={config.hidden_size} is not a multiple of "
                             f"num_attention_heads={heads}, and the config has no head_dim")
        values["hidden_size"] = values["num_attention_heads"] * (config.hidden_size // heads)
    for key in INTERMEDIATE_KEYS:
        if isinstance(getattr(config, key, None), int) and getattr(config, key) > 0:
            values[key] = _round_up(INTERMEDIATE, tp)
    if "hidden_size" in values:  # widths that equal the hidden size follow it
        values.update({key: values["hidden_size"] for key, value in vars(config).items()
                       if key not in values and _same_int(value, config.hidden_size)
                       and FOLLOWS_HIDDEN_KEY.search(key) and not NOT_HIDDEN_WIDTH.search(key)})
    if isinstance(getattr(config, "vocab_size", None), int):
        values["vocab_size"] = _round_up(VOCAB, tp)
        values.update(vocab_like(config, values["vocab_size"]))
    values.update(_expert_counts(config, ep, where))
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and not isinstance(window, bool) and window > 0:
        values["sliding_window"] = max(2, seq_len // 2)
    for key, value in values.items():
        _set(probe, key, value, where)
    for key in TOKEN_ID_KEYS:  # special tokens must stay inside the smaller vocabulary
        token = getattr(probe, key, None)
        if isinstance(token, int) and token >= values.get("vocab_size", math.inf):
            _set(probe, key, values["vocab_size"] - 1 - TOKEN_ID_KEYS.index(key), where)
    zero_dropout(probe, where)
    if overrides is not None:
        layers = config.per_layer_config
        probe = with_layer_overrides(probe, {index: _shrink_layer(own, layers[index], tp=tp, ep=ep, seq_len=seq_len,
                                                                  where=f"{where} per_layer_config[{index}]")
                                             for index, own in overrides.items()}, where)
    return probe


def _has_attention_heads(config: Any) -> bool:
    """Whether the config names attention heads under any key (``attribute_map`` aliases
    included): a config without is a pure state-space / recurrent model."""
    names = {"num_attention_heads", *getattr(config, "attribute_map", {}).keys()}
    return any(isinstance(getattr(config, name, None), int) for name in names if "attention_heads" in name)


def _probe_heads(config: Any, tp: int, where: str) -> dict[str, int]:
    """The probe's query and kv heads for a config (or one layer's view of it)."""
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        raise ProbeError(f"{where}: num_attention_heads: expected a positive integer to shrink the verify "
                         f"probe by, got {heads!r}")
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % kv:
        raise ProbeError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    # at least 2 kv heads where the model has them: some split K/V by head pairs (DiffLlama)
    fewest = max(tp, 2)
    kv_probe = fewest if kv % fewest == 0 and kv > fewest else kv
    values = {"num_attention_heads": kv_probe * (heads // kv)}
    if getattr(config, "num_key_value_heads", None) is not None:
        values["num_key_value_heads"] = kv_probe
    return values


def _shrink_layer(own: dict[str, Any], layer: Any, *, tp: int, ep: int, seq_len: int, where: str) -> dict[str, Any]:
    """One layer's own values of a per-layer config, shrunk by the model-wide rules:
    heads from that layer's heads and kv heads, intermediate sizes, expert counts and
    windows as for the whole model; other values (head widths, rope settings) kept."""
    shrunk = dict(own)
    if {"num_attention_heads", "num_key_value_heads"} & set(own):
        # both counts, even where the layer sets one: the model-wide shrink of the other
        # came from the model-wide counts, not this layer's (a kv override alone would leave
        # fewer query heads than kv heads)
        shrunk.update(_probe_heads(layer, tp, where))
    if "hidden_size" in own:
        raise ProbeError(f"{where}: hidden_size differs by layer; the verify probe shrinks one model-wide width")
    for key in INTERMEDIATE_KEYS:
        if isinstance(own.get(key), int) and own[key] > 0:
            shrunk[key] = _round_up(INTERMEDIATE, tp)
    experts = next(iter(_expert_counts(layer, ep, where).values()), None)
    aliases = set(EXPERT_COUNT_KEYS) | {getattr(layer, "attribute_map", {}).get(key) for key in EXPERT_COUNT_KEYS}
    shrunk.update({key: experts for key in own if experts is not None and key in aliases})
    window = own.get("sliding_window")
    if isinstance(window, int) and not isinstance(window, bool) and window > 0:
        shrunk["sliding_window"] = max(2, seq_len // 2)
    # dropout per layer too: verify runs in training mode (zero_dropout, model-wide)
    shrunk.update({key: 0.0 for key, value in own.items() if DROPOUT_KEY.search(key) and isinstance(value, float)})
    return shrunk


def with_layer_overrides(probe: Any, overrides: dict[int, dict[str, Any]], where: str) -> Any:
    """``probe`` with these per-layer values (transformers' ``per_layer_config``) in place
    of its own, and per-layer sizes readable only per layer again."""
    probe.__dict__.pop("allow_global_per_layer_attribute_access", None)
    try:
        probe.per_layer_config = None
        probe.per_layer_config = overrides
    except (TypeError, ValueError) as exc:
        raise ProbeError(f"{where}: per_layer_config: cannot shrink it for the verify probe: {exc}") from None
    return probe


def vocab_like(config: Any, vocab: int) -> dict[str, int]:
    """Other vocabulary sizes larger than ``vocab`` (Gemma 3n's vocab_size_per_layer_input,
    a per-layer embedding table of 262144 rows), set to it: the ids index them too."""
    return {key: vocab for key, value in vars(config).items()
            if key.startswith("vocab_size_") and isinstance(value, int) and not isinstance(value, bool) and value > vocab}


def _same_int(value: Any, other: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value == other


def zero_dropout(config: Any, where: str) -> None:
    """Set every dropout probability of ``config`` and of its sub-configs to 0, in place:
    float attributes named like ``DROPOUT_KEY`` (``attention_dropout``, ``hidden_dropout``,
    ``resid_pdrop``, ``layerdrop``, ...). Found by name, so every family's keys are met."""
    for key, value in list(vars(config).items()):
        if _is_config(value):
            zero_dropout(value, f"{where} {key}")
        elif DROPOUT_KEY.search(key) and isinstance(value, float) and value:
            _set(config, key, 0.0, where)


def _is_config(value: Any) -> bool:
    """A nested transformers config (``text_config``, dbrx's ``attn_config``, ...)."""
    from transformers import PretrainedConfig

    return isinstance(value, PretrainedConfig)


def _expert_counts(config: Any, ep: int, where: str) -> dict[str, int]:
    key = _first_key(config, EXPERT_COUNT_KEYS)
    if key is None or getattr(config, key) <= 1:
        return {}
    experts = getattr(config, key)
    top_k_key = _first_key(config, TOP_K_KEYS)
    top_k = getattr(config, top_k_key) if top_k_key else 1
    group_key, top_group_key = _first_key(config, EXPERT_GROUP_KEYS), _first_key(config, TOP_GROUP_KEYS)
    groups = (getattr(config, group_key) if group_key else None) or 1
    top_groups = min((getattr(config, top_group_key) if top_group_key else None) or groups, groups)
    multiple = math.lcm(ep, groups)
    if experts % multiple:
        raise ProbeError(f"{where}: {key}={experts} is not a multiple of ep_size={ep} and "
                         f"{group_key or 'n_group'}={groups}")
    # group-limited routing picks top_k among the chosen groups' experts: enough of them
    routable = math.ceil(top_k * groups / top_groups)
    probe_experts = min(experts, _round_up(max(2 * ep, top_k, routable, 4), multiple))
    return {key: probe_experts}


def _set(config: Any, key: str, value: Any, where: str) -> None:
    try:
        setattr(config, key, value)
    except (TypeError, ValueError) as exc:  # strict configs validate on set
        raise ProbeError(f"{where}: {key}: cannot shrink to {value!r} for the verify probe: {exc}") from None


def per_layer_keys(config: Any) -> set[str]:
    """The config's lists with one entry per layer. A list as long as the model is deep is
    one when its name says layers (``layer_types``, ``layers_block_type``), or when the
    config class, built at another depth, derives a list of that depth for it; a pair that
    happens to have as many entries as the model has layers (``time_step_limit`` (min,
    max), ``mlp_multipliers`` (gate, down) at depth 2) is not, nor is a list of layer
    indices (cutting it by position would keep the wrong layers' numbers)."""
    full = config.num_hidden_layers
    candidates = {key for key, value in vars(config).items()
                  if isinstance(value, (list, tuple)) and len(value) == full and full > 1
                  and key != "architectures" and not LAYER_INDEX_KEY.search(key)}
    per_layer = {key for key in candidates if PER_LAYER_KEY.search(key)}
    if candidates - per_layer:
        try:
            deeper = type(config)(num_hidden_layers=full + 1)
        except Exception:  # noqa: BLE001 -- a class that cannot be built bare decides nothing
            deeper = None
        per_layer |= {key for key in candidates - per_layer
                      if isinstance(getattr(deeper, key, None), (list, tuple)) and len(getattr(deeper, key)) == full + 1}
    return per_layer


def depth_aliases(config: Any) -> list[str]:
    """Other integer keys that count the layers, equal to ``num_hidden_layers`` (xLSTM
    builds ``num_blocks`` blocks; its ``num_hidden_layers`` is a separate copy): cut with it."""
    depth = getattr(config, "num_hidden_layers", None)
    return [key for key, value in vars(config).items()
            if key != "num_hidden_layers" and type(value) is int and value == depth and DEPTH_ALIAS_KEY.fullmatch(key)]


def cut_depth(config: Any, layers: int, where: str) -> Any:
    """A copy of ``config`` with its first ``layers`` layers; per-layer lists cut alike."""
    overrides = layer_overrides(config)
    probe = copy.deepcopy(config)
    per_layer = {key: getattr(config, key)[:layers] for key in per_layer_keys(config)}
    # Depth counts of their own that the model may build by (xLSTM's ``num_blocks``).
    per_layer.update({key: layers for key in depth_aliases(config)})
    # Set the lists and the depth together: strict configs check their lengths agree.
    try:
        if overrides is not None:  # a per-layer config's layer indices must stay below the depth
            probe.per_layer_config = None
        probe.__dict__.update(per_layer)
        probe.num_hidden_layers = layers
    except (TypeError, ValueError) as exc:
        raise ProbeError(f"{where}: num_hidden_layers: cannot cut to {layers} for the verify probe: {exc}") from None
    if overrides is not None:
        probe = with_layer_overrides(probe, {i: own for i, own in overrides.items() if i < layers}, where)
    return probe


def layer_kinds(model: Any, config: Any) -> list[tuple]:
    """One hashable kind per decoder layer: its modules' types and parameter shapes, the
    kind attributes of its modules, and its entry in the config's ``layer_types``."""
    layers = decoder_layers(model, config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    kinds = []
    for index, layer in enumerate(layers):
        parts = []
        for name, module in layer.named_modules():
            attrs = tuple((a, repr(getattr(module, a))) for a in KIND_ATTRIBUTES if hasattr(module, a))
            params = tuple((n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False))
            parts.append((name, type(module).__name__, params, attrs))
        layer_type = types[index] if isinstance(types, (list, tuple)) and index < len(types) else None
        kinds.append((layer_type, tuple(parts)))
    return kinds


def decoder_layers(model: Any, count: int) -> list[Any]:
    """The model's decoder layers (``model_parts.decoder_layers``), which must number
    ``count`` (num_hidden_layers) or a whole fraction of it (``sublayers_per_layer``):
    the probe cuts the depth through that key."""
    from hyper_parallel.distributed.model_parts import decoder_layers as find_layers

    found = find_layers(model)
    if found is None or not found[1] or count % len(found[1]):
        got = "no ModuleList of layers" if found is None else f"{found[0]} holds {len(found[1])}"
        raise ProbeError(f"{type(model).__name__}: the verify probe cuts the depth through num_hidden_layers="
                         f"{count}, but the decoder layers do not number that or a whole fraction of it ({got}); "
                         "such a model cannot be verified yet")
    return list(found[1])


def sublayers_per_layer(model: Any, config: Any) -> int:
    """How many of ``num_hidden_layers`` one decoder layer counts: 1, or k where the config
    counts k sublayers in each (Longcat-Flash: two attention sublayers per layer,
    ``num_hidden_layers = 2 * num_layers``). The probe's depth in layers times this is
    the ``num_hidden_layers`` it is cut to."""
    return config.num_hidden_layers // len(decoder_layers(model, config.num_hidden_layers))


def shortest_faithful_depth(full_kinds: list[tuple]) -> int:
    """The fewest leading layers that hold every kind of the full model."""
    wanted = set(full_kinds)
    seen: set = set()
    for index, kind in enumerate(full_kinds):
        seen.add(kind)
        if seen == wanted:
            return index + 1
    return len(full_kinds)


def faithful_probe_config(wide: Any, *, remote: bool, where: str, min_depth: int = 1) -> tuple[Any, int, list[tuple]]:
    """``wide`` (``shrink_widths``' output) cut to the shortest prefix of layers that holds
    every layer kind of the full depth, and at least ``min_depth`` layers (2 where the
    sequence is split: the model's code between two layers runs on the pieces too):
    (the cut config, its depth, the full depth's kinds). The kinds come from the model
    built on the meta device (no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        full = AutoModelForCausalLM.from_config(wide, trust_remote_code=remote)
    kinds = layer_kinds(full, wide)
    depth = min(len(kinds), max(min_depth, shortest_faithful_depth(kinds)))
    per_layer = sublayers_per_layer(full, wide)
    for deeper in range(depth, len(kinds) + 1):
        # a model may not build at every depth (Zamba ties its shared block's weights across
        # at least two hybrid layers): the next depth, up to the whole model
        cut = cut_depth(wide, deeper * per_layer, where)
        try:
            with torch.device("meta"):
                AutoModelForCausalLM.from_config(cut, trust_remote_code=remote)
        except Exception as exc:  # noqa: BLE001 -- the model's own constructor, any error
            failure = exc
            continue
        return cut, deeper, kinds
    raise ProbeError(f"{where}: num_hidden_layers: the model does not build at any depth from {depth} to {len(kinds)} "
                     f"layers for the verify probe ({type(failure).__name__}: {str(failure).splitlines()[0][:200]})")
