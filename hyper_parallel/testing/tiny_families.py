"""Tiny configs and random checkpoints of decoder families (see the package docstring).

A transformers family: its config class built from ``TINY`` (the fields it has, through
its ``attribute_map``), its ``FAMILY_FIXES``, no dropout, 2-4 layers holding every layer
kind of its default depth (``tiny_config``). A remote-code fixture (``remote:<folder>`` of
``tests/data/remote_code``): its own config.json.
"""

import dataclasses
import functools
import inspect
import json
import shutil
import warnings
from pathlib import Path

import torch
import transformers
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from hyper_parallel.codegen.check.probe import (
    ProbeError,
    cut_depth,
    layer_kinds,
    shortest_faithful_depth,
    vocab_like,
    zero_dropout,
)

REPO = Path(__file__).resolve().parents[2]
REMOTE_DATA = REPO / "tests" / "data" / "remote_code"  # remote-code decoder fixtures, one folder each
REMOTE_PREFIX = "remote:"

# Canonical attribute names; a config class's attribute_map translates them to its own fields.
TINY = {
    "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128, "use_cache": False,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_ffn_hidden_size": 32,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "num_experts_per_token": 2, "moe_k": 2,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 16, "rotary_dim": 8, "unpadded_vocab_size": 256,
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
    "index_n_heads": 2, "index_head_dim": 16, "index_topk": 8,
}
# Multi-head latent attention: the rotary embedding is sized by head_dim = the rope part, and
# keys/values are decompressed per query head (no grouped-query attention).
MLA = {"head_dim": TINY["qk_rope_head_dim"], "num_key_value_heads": TINY["num_attention_heads"]}
SLIDING_WINDOW = 8  # only where the family has a window by default (None keeps full attention)
# What the generic widths cannot express, per family: passed to the config class as given
# (also keys that are constructor keywords but not fields).
FAMILY_FIXES = {
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},  # read unconditionally
             "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}},
    "cohere_compass_text": {"rope_parameters": {kind: {"rope_type": "default", "rope_theta": 10000.0}
                                                for kind in ("full_attention", "sliding_attention")}},
    "longcat_flash": {"zero_expert_num": 2},
    "dory": {"num_hidden_layers": 4, "n_input_layers": 1, "n_recurrent_layers": 2, "n_output_layers": 1},
    # Sliding layers have their own MLA widths (swa_* keywords become per_layer_config).
    "dots3_note_text": {"swa_num_attention_heads": 2, "swa_num_key_value_heads": 2, "swa_q_lora_rank": 32,
                        "swa_kv_lora_rank": 16, "swa_head_dim": 16, "swa_qk_nope_head_dim": 8, "swa_v_head_dim": 16},
    "hrm_text": {"num_layers_per_stack": 2, "H_cycles": 1, "L_cycles": 2},
    "zaya": {"num_experts_per_tok": 1},  # "ZAYA currently supports num_experts_per_tok=1 only"
    "dots1": {"n_shared_experts": 1},  # None (the default) fails in the MoE block
    # the class's default makes every layer attention; LFM2's checkpoints are mostly short
    # convolutions (the layer kind the family exists for)
    "lfm2": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]},
    # Full-attention layers' own head width (per_layer_config) defaults to 512: 8x the tiny
    # hidden size, which no real checkpoint has and which scales float noise past the tolerances.
    "gemma4_text": {"global_head_dim": 32},
    "gemma4_unified_text": {"global_head_dim": 32},
    # the shared transformer's weights are tied across hybrid layers: at least two of them
    "zamba": {"num_hidden_layers": 8},
    # sparse indexed attention needs its indexer widths; the n-gram vocabulary made small
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 4, "ngram_vocab_size_base": 512,
                       "make_ngram_vocab_size_divisible_by": 8, "split_ngram_parts": 8, "num_hidden_layers": 4},
    # hidden_size * expand must equal num_heads * head_dim (the defaults are 128 heads of 64)
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 2},
    # layer_types has no default: convolution and attention layers, the first dense
    "lfm2_moe": {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
                 "num_dense_layers": 1},
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2,
                     "layer_types": ["sliding_attention", "full_attention"] * 2},
}
# A composite (vision-language) config's towers at their smallest: the sweep trains its text
# decoder; the towers only have to build and save (their weights are real checkpoint names).
TINY_TOWER = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 2,
              "temporal_patch_size": 1, "spatial_merge_size": 1, "num_position_embeddings": 16}
TOKEN_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id")
MAX_LAYERS = 4


def config_fields(config_class) -> set[str]:
    """transformers 5 configs are dataclasses: their fields are what the constructor accepts."""
    if dataclasses.is_dataclass(config_class):
        return {f.name for f in dataclasses.fields(config_class)}
    return set(inspect.signature(config_class.__init__).parameters)


def class_defaults(config_class) -> dict:
    """Field -> default value of a dataclass config (MISSING where there is none)."""
    if not dataclasses.is_dataclass(config_class):
        return {}
    return {f.name: f.default for f in dataclasses.fields(config_class)}


def config_kwargs(config_class, values: dict) -> dict:
    """``values`` in the class's own field names (``attribute_map``: hidden_size -> n_embd);
    names the class does not have are dropped, so one table serves every family."""
    fields, amap = config_fields(config_class), getattr(config_class, "attribute_map", {}) or {}
    out = {}
    for key, value in values.items():
        real = amap.get(key, key)
        if real in fields and value is not None:
            out[real] = value
    return out


def construct_config(family: str, extra: dict | None = None):
    """The family's config class with TINY (the fields it has) + its fixes + ``extra``; GQA
    is dropped where the class validates that kv heads equal heads."""
    config_class = CONFIG_MAPPING[family]
    defaults = class_defaults(config_class)
    values = {**TINY, **(MLA if "qk_rope_head_dim" in defaults else {})}
    if isinstance(defaults.get("sliding_window"), int):
        values["sliding_window"] = SLIDING_WINDOW
    amap = getattr(config_class, "attribute_map", {}) or {}
    explicit = {amap.get(k, k): v for k, v in {**FAMILY_FIXES.get(family, {}), **(extra or {})}.items()}
    kwargs = {**config_kwargs(config_class, values), **explicit}
    try:
        config = config_class(**kwargs)
    except Exception as exc:  # strict configs raise their own validation error class
        kv = amap.get("num_key_value_heads", "num_key_value_heads")
        if "num_key_value_heads" not in str(exc) or kv not in kwargs:
            raise
        config = config_class(**{**kwargs, kv: kwargs.get(amap.get("num_attention_heads", "num_attention_heads"))})
    # Dropout makes a parallel run differ from one process by its random masks, not by its
    # plan: zeroed by the rule verify's probe uses (BioGPT's hidden_dropout_prob included).
    zero_dropout(config, family)
    if isinstance(getattr(config, "vocab_size", None), int):
        for key, value in vocab_like(config, config.vocab_size).items():
            setattr(config, key, value)  # per-layer embedding tables as small as the vocabulary
    vocab = getattr(config, "vocab_size", None)
    for index, key in enumerate(TOKEN_ID_KEYS):  # special tokens inside the small vocabulary
        token = getattr(config, key, None)
        if isinstance(vocab, int) and isinstance(token, int) and token >= vocab:
            setattr(config, key, index)
    return config


def meta_model(config):
    """The model on the meta device: structure without memory."""
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                trust_remote_code=is_remote_config(config))


def kinds_of(config) -> set | None:
    """Distinct layer kinds (verify's probe definition: module types, shapes, sliding/full,
    layer_types entry); None where the model has no ModuleList of num_hidden_layers."""
    try:
        return set(layer_kinds(meta_model(config), config))
    except (ProbeError, AttributeError):
        return None


@functools.lru_cache(maxsize=None)
def tiny_config(family: str):
    """2-4 layers holding every layer kind of the family's default depth: the config class
    built at 2, 3, 4 layers (it derives its own layer pattern), else the default pattern cut
    short, else ``layer_types`` reordered so each distinct type comes early. Cached: callers
    read it, never change it. A remote-code fixture's tiny config is its own config.json."""
    if is_remote(family):
        return transformers.AutoConfig.from_pretrained(remote_folder(family), trust_remote_code=True)
    if is_composite(family):
        return composite_config(family)
    full = construct_config(family)
    if "num_hidden_layers" in FAMILY_FIXES.get(family, {}) or not isinstance(
            getattr(full, "num_hidden_layers", None), int):
        return full
    wanted = kinds_of(full)
    if wanted is None:
        return construct_config(family, {"num_hidden_layers": 2})
    depth = max(2, shortest_faithful_depth(layer_kinds(meta_model(full), full)))
    candidates = [lambda layers=layers: construct_config(family, {"num_hidden_layers": layers})
                  for layers in range(2, MAX_LAYERS + 1)]
    if depth <= MAX_LAYERS:
        candidates.append(lambda: cut_depth(full, depth, family))
    types = getattr(full, "layer_types", None)
    if isinstance(types, (list, tuple)) and types:
        distinct = list(dict.fromkeys(types))
        for layers in range(max(2, len(distinct)), MAX_LAYERS + 1):
            order = (distinct * MAX_LAYERS)[:layers]
            candidates.append(lambda order=order: construct_config(
                family, {"num_hidden_layers": len(order), "layer_types": order}))
    for make in candidates:
        try:
            config = make()
        except Exception:  # this way of cutting does not fit the class; try the next
            continue
        if (kinds_of(config) or set()) >= wanted:
            return config
    return cut_depth(full, min(depth, 2 * MAX_LAYERS), family)


def is_composite(family: str) -> bool:
    """A composite (vision-language) config whose causal-LM class is its text decoder alone:
    ``AutoModelForCausalLM`` builds the decoder from ``text_config`` (Qwen3.5)."""
    from hyper_parallel.codegen.plan.derive import text_decoder_config

    if is_remote(family) or "text_config" not in (getattr(CONFIG_MAPPING[family], "sub_configs", {}) or {}):
        return False
    config = CONFIG_MAPPING[family]()
    return text_decoder_config(config) is not config


def composite_config(family: str):
    """The composite config with the text family's tiny config as ``text_config`` and towers
    at their smallest (``TINY_TOWER``, the fields each tower config has)."""
    config_class = CONFIG_MAPPING[family]
    text = tiny_config(config_class.sub_configs["text_config"].model_type)
    towers = {name: {key: value for key, value in TINY_TOWER.items() if key in class_defaults(sub)}
              for name, sub in config_class.sub_configs.items() if name != "text_config"}
    for tower in towers.values():
        if "out_hidden_size" in class_defaults(config_class.sub_configs["vision_config"]):
            tower["out_hidden_size"] = text.hidden_size  # the projector writes the decoder's width
    return config_class(text_config=text.to_dict(), **towers)


def is_moe(config) -> bool:
    """MoE when some module holds experts (packed tensors or a list of expert MLPs)."""
    return any(name.rsplit(".", 1)[-1] == "experts" or "Experts" in type(module).__name__
               for name, module in meta_model(config).named_modules())


def remote_families() -> list[str]:
    """``remote:<folder>`` for every remote-code fixture: a folder of REMOTE_DATA whose
    config.json maps AutoModelForCausalLM in its ``auto_map``."""
    found = []
    for folder in sorted(REMOTE_DATA.iterdir()) if REMOTE_DATA.is_dir() else []:
        config = folder / "config.json"
        if config.is_file() and "AutoModelForCausalLM" in json.loads(config.read_text()).get("auto_map", {}):
            found.append(REMOTE_PREFIX + folder.name)
    return found


def is_remote(family: str) -> bool:
    return family.startswith(REMOTE_PREFIX)


def remote_folder(family: str) -> Path:
    return REMOTE_DATA / family[len(REMOTE_PREFIX):]


def is_remote_config(config) -> bool:
    """A config loaded from a remote-code folder (transformers' own configs have no auto_map)."""
    return bool(getattr(config, "auto_map", None))


def family_dir(family: str) -> str:
    """The family's folder name in the throwaway project (no ``:`` in paths)."""
    return family.replace(":", "-")


def save_checkpoint(family: str, model_dir: Path) -> None:
    """Random weights for the tiny config, written by transformers itself (real tensor names).
    A remote-code fixture's save_pretrained also writes its config.json (with ``auto_map``)
    and copies its code; the fixture's own .py files are copied over them, so the model
    folder runs exactly the fixture's bytes."""
    config = tiny_config(family)
    remote = is_remote(family)
    # a composite checkpoint is the whole vision-language model's (its towers' tensors too)
    auto = transformers.AutoModelForImageTextToText if is_composite(family) else AutoModelForCausalLM
    torch.manual_seed(1234)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = auto.from_config(config, dtype=torch.float32, attn_implementation="eager", trust_remote_code=remote)
        model.save_pretrained(model_dir)
    if remote:
        for source in remote_folder(family).glob("*.py"):
            shutil.copyfile(source, model_dir / source.name)
