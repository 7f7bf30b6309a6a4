"""Coverage sweep: every decoder family transformers ships, generated and verified per layout.

    python bench/family_sweep.py                                 # every kept family, every layout
    python bench/family_sweep.py --families llama,qwen3,mixtral --layouts tp2,cp2
    python bench/family_sweep.py --list                          # kept and skipped families only
    python bench/family_sweep.py --families llama --keep /tmp/sweep --no-docs
    python bench/family_sweep.py --remote-only --no-peer           # the remote-code fixtures only
    python bench/family_sweep.py --families remote:list_moe --layouts ep2

What it does (issue 11, items 1 and 2):

1. Families. Every model type in transformers' causal-LM auto mapping
   (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``). Kept: attention-based, decoder-only text LMs.
   Skipped, each with its reason: encoder-decoder models and the decoder halves of them,
   encoders with an LM head (attention not causal by default), multimodal or otherwise
   composite configs (their text model is usually its own ``*_text`` type), state-space /
   recurrent / linear-attention / short-convolution hybrids (decided from the classes the
   family's modeling module defines), speculative-decoding assistants, and types whose tiny
   model cannot be built offline.
2. A tiny config per family, built from its config class (``tiny_config``): hidden 64,
   4 heads with 2 kv heads where the class has ``num_key_value_heads``, head_dim 16,
   intermediate 128 (experts 32), vocabulary 256, 4 experts with top-k 2, 2-4 layers chosen
   so that every distinct layer kind of the family's default depth appears (sliding/full,
   dense/MoE, ...). Random weights are saved with ``save_pretrained``, so the checkpoint has
   the tensor names transformers really writes.
3. Per family and layout (``tp2``, ``tp2_sp_lp``, ``cp2``, ``dp2``; for MoE families also
   ``ep2`` = dp2 + ep2 and ``tp2_ep2`` = tp2 + dp2 + ep2 at world 4; ep is borrowed from
   dp*cp) a recipe in a throwaway project and ``python -m hyper_parallel.codegen --verbose
   generate --skip-preflight``. Generate runs the verify stage: the bundle at the recipe's
   world size against single-process HF on a shrunk probe, two AdamW steps, loss (rtol 1e-5)
   and every parameter's gradient (rtol 1e-4). Then, for rows that generated, the gen
   backend trains the saved checkpoint for 3 AdamW steps under torchrun
   (``hyper_parallel.trainer``; each rank reads its slices of the checkpoint) against
   single-process HF training on the same data: loss rtol 1e-5 and gradient norm rtol 1e-4
   at every step (``--no-train`` skips this).
   Status: ``pass`` (generated, verified, trained equal); ``refused`` (generate exited 2,
   the CLI's code for bad input and the project's refusals, with one of the project's own
   error classes from resolve / derive / freeze or the verify probe, i.e. a clean error
   naming a module or key); ``fail`` (anything else: a verify mismatch, a crash in a stage
   or in verify's ranks, a refusal-class error with another exit code, a training mismatch
   or crash, a timeout). A training crash's reason names torchrun's exit code, the rank that
   failed first and how (``killed by SIGABRT (exit -6)``), the last step logged, and the
   rank's exception or else the last lines the ranks wrote to stderr.
4. Remote-code fixtures. Every folder of ``tests/data/remote_code/`` (a config.json with an
   ``auto_map``, its ``configuration_*.py`` and ``modeling_*.py``) is swept too, as family
   ``remote:<folder>``: decoders transformers does not ship, with module names and block
   structures no transformers family has. The fixture's own config.json is its tiny
   config; its checkpoint is written by ``save_pretrained`` of
   ``AutoModelForCausalLM.from_config(..., trust_remote_code=True)`` (which copies the
   code beside the weights), and its recipes set ``model.trust_remote_code: true``. A
   fixture with experts gets the MoE layouts. ``--remote-only`` runs only these (and does
   not enumerate transformers' families); the summary counts them apart from the kept
   transformers families.
5. Peer column: the same checkpoints through transformers' own
   ``from_pretrained(dir, tp_plan="auto")`` at tp2 (torchrun, world 2, gloo; several
   families per launch, ``bench/family_sweep_worker.py``) against single-process HF, 3 AdamW
   steps, loss rtol 1e-5 and gradient norm rtol 1e-4: ``pass`` / ``fail`` / ``unsupported``
   (the config has no ``base_model_tp_plan``; so for a remote-code fixture unless it
   defines one).

Prints a table and a summary line; writes ``docs/families.md`` and ``docs/families.json``
(``--no-docs``: don't) with exactly the rows that were run: a run over fewer families or
layouts than the full sweep says so ("partial run") in both the summary and the docs.
Progress goes to stderr, one line per case with its seconds. Runs subprocesses with
OMP_NUM_THREADS=1 and no torchrun variables; ``--jobs N`` runs N cases at a time.
"""

import argparse
import concurrent.futures
import dataclasses
import functools
import importlib
import inspect
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers
import yaml
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hyper_parallel.codegen.check.probe import ProbeError, cut_depth, layer_kinds, shortest_faithful_depth
from hyper_parallel.codegen.spec.types import STAGES
from hyper_parallel.trainer.reference import reference_training

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "bench" / "family_sweep_worker.py"
REMOTE_DATA = REPO / "tests" / "data" / "remote_code"  # remote-code decoder fixtures, one folder each
REMOTE_PREFIX = "remote:"
DOCS_MD, DOCS_JSON = REPO / "docs" / "families.md", REPO / "docs" / "families.json"
REGENERATE = "python bench/family_sweep.py"

# layout -> accelerator keys; ep is borrowed from dp*cp, so ep2 needs dp2 (DESIGN §3).
LAYOUTS = {
    "tp2": {"tp_size": 2},
    "tp2_sp_lp": {"tp_size": 2, "sequence_parallel": True, "loss_parallel": True},
    "cp2": {"cp_size": 2},
    "dp2": {"dp_size": 2},
    "ep2": {"dp_size": 2, "ep_size": 2},
    "tp2_ep2": {"tp_size": 2, "dp_size": 2, "ep_size": 2},
}
MOE_LAYOUTS = ("ep2", "tp2_ep2")
TRAIN_STEPS, LOSS_RTOL, NORM_RTOL = 3, 1e-5, 1e-4

# --- tiny configs ------------------------------------------------------------------------------

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
# Dropout makes a parallel run differ from one process by its random masks, not by its plan.
DROPOUT_FIELD = re.compile(r"(dropout|pdrop|drop_rate|layerdrop)$")
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
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2,
                     "layer_types": ["sliding_attention", "full_attention"] * 2},
}
TOKEN_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id")
MAX_LAYERS = 4

# --- which families are swept ------------------------------------------------------------------

# Classes a family's modeling module defines that make it state-space / recurrent / linear-attention.
RECURRENT_CLASS = re.compile(r"Mixer$|MambaLayer$|RwkvSelfAttention$|xLSTMLayer$|Rglru$|RecurrentBlock$|DeltaNet$|"
                             r"DeltaAttention$|LightningAttention$|ShortConv$")
MULTIMODAL_SUBCONFIG = re.compile(r"vision|audio|vq|speech|image|text_config|encoder|decoder|patcher")
# Decided by reading the modeling code; no config flag says so.
SKIP_BY_READING = {
    "xlnet": "permutation LM with two-stream relative attention (XLNetRelativeAttention), not a causal decoder",
    "trocr": "decoder half of an encoder-decoder (TrOCR, the text decoder of a VisionEncoderDecoder)",
    "gemma4_assistant": "speculative-decoding assistant: reads a backbone's hidden states and shared KV "
                        "(pre_projection of 2 x backbone_hidden_size), not a standalone LM",
    "gemma4_unified_assistant": "speculative-decoding assistant: reads a backbone's hidden states and shared KV, "
                                "not a standalone LM",
}


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
    values.update({name: 0.0 for name, value in defaults.items()
                   if DROPOUT_FIELD.search(name) and isinstance(value, float)})
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


def modeling_module(family: str):
    """The family's modeling module (what resolve reads), by the auto mapping's naming."""
    name = model_type_to_module_name(family)
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def module_classes(family: str) -> list[str]:
    """The nn.Module classes the family's modeling module defines itself."""
    try:
        module = modeling_module(family)
    except ImportError:
        return []
    return sorted(name for name, cls in inspect.getmembers(module, inspect.isclass)
                  if cls.__module__ == module.__name__ and issubclass(cls, torch.nn.Module))


def skip_reason(family: str) -> str | None:
    """Why a type of the causal-LM mapping is not an attention-based decoder-only text LM
    (or cannot be built offline); None when it is swept."""
    if family in SKIP_BY_READING:
        return SKIP_BY_READING[family]
    config_class = CONFIG_MAPPING[family]
    subs = sorted(getattr(config_class, "sub_configs", {}) or {})
    if any(MULTIMODAL_SUBCONFIG.search(name) for name in subs):
        return f"composite/multimodal config ({', '.join(subs)})"
    defaults = class_defaults(config_class)
    if defaults.get("is_encoder_decoder") is True:
        return "encoder-decoder (is_encoder_decoder=True); its causal-LM class is the decoder half"
    classes = module_classes(family)
    if defaults.get("is_decoder") is False and any(name.endswith("Encoder") for name in classes):
        return "encoder with an LM head (is_decoder=False by default; a bidirectional encoder stack)"
    mixers = [name for name in classes if RECURRENT_CLASS.search(name)]
    if mixers:
        return f"state-space/recurrent or linear-attention layers ({', '.join(mixers)})"
    try:
        model = meta_model(tiny_config(family))
    except Exception as exc:  # recorded: the type cannot be built offline
        return f"cannot build a tiny model offline: {type(exc).__name__}: {first_line(str(exc))}"
    causal = [m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    if causal and not any(causal):
        return "encoder with an LM head (self-attention is not causal by default, is_decoder=False)"
    if getattr(model.config, "is_encoder", False):
        return "encoder (masked LM; config.is_encoder=True)"
    return None


def is_moe(config) -> bool:
    """MoE when some module holds experts (packed tensors or a list of expert MLPs)."""
    return any(name.rsplit(".", 1)[-1] == "experts" or "Experts" in type(module).__name__
               for name, module in meta_model(config).named_modules())


def enumerate_families() -> tuple[list[str], dict[str, str]]:
    """(kept families sorted, {skipped family: reason})."""
    kept, skipped = [], {}
    for family in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        reason = skip_reason(family) if family in CONFIG_MAPPING else "no config class in CONFIG_MAPPING"
        if reason is None:
            kept.append(family)
        else:
            skipped[family] = reason
    return kept, skipped


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


def first_line(text: str, limit: int = 240) -> str:
    """One trimmed line of an error message for a table cell."""
    line = next((part.strip() for part in text.strip().splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


# --- one case: recipe, generate, train ---------------------------------------------------------

# The project's own "cannot plan this" errors: a clean refusal when raised before emit or by
# verify's probe, and the CLI exits EXIT_REFUSED for them. Anything else (TypeError,
# KeyError, a VerifyError, ...) is a fault.
REFUSAL_ERRORS = {"DeriveError", "PlanError", "FreezeError", "PlanFormatError", "PlacementTextError",
                  "SourceError", "RecipeError", "ProbeError"}
REFUSAL_STAGES = ("resolve", "derive", "freeze")
EXIT_REFUSED = 2  # python -m hyper_parallel.codegen: bad input and the project's refusals
EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\w*): ?(.*)$")


@dataclasses.dataclass
class Case:
    family: str
    layout: str
    status: str = ""
    reason: str = ""
    generate_s: float = 0.0
    train_s: float = 0.0


def clean_env() -> dict:
    """Subprocesses run as a user's shell would: no torchrun variables, one thread each."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    return env


def make_project(dest: Path) -> Path:
    """A throwaway project: dodo.py as bench/gen_vs_peer.py's make_project copies it, and an
    empty recipes/ that the sweep fills (one folder per family, one per layout below it)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "dodo.py", dest / "dodo.py")
    (dest / "recipes").mkdir(exist_ok=True)
    return dest


def save_checkpoint(family: str, model_dir: Path) -> None:
    """Random weights for the tiny config, written by transformers itself (real tensor names).
    A remote-code fixture's save_pretrained also writes its config.json (with ``auto_map``)
    and copies its code; the fixture's own .py files are copied over them, so the model
    folder runs exactly the fixture's bytes."""
    config = tiny_config(family)
    remote = is_remote(family)
    torch.manual_seed(1234)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager",
                                                 trust_remote_code=remote)
        model.save_pretrained(model_dir)
    if remote:
        for source in remote_folder(family).glob("*.py"):
            shutil.copyfile(source, model_dir / source.name)


def world_of(layout: str) -> int:
    acc = LAYOUTS[layout]
    return acc.get("tp_size", 1) * acc.get("cp_size", 1) * acc.get("dp_size", 1)


def write_recipe(project: Path, family: str, layout: str) -> Path:
    """recipes/<family>/<layout>/recipe.yaml next to recipes/<family>/model (the checkpoint);
    the shape of recipes/tiny_cpu/qwen3_moe_tiny.yaml, with this layout's parallel sizes
    (and ``model.trust_remote_code: true`` for a remote-code fixture)."""
    world = world_of(layout)
    dp = LAYOUTS[layout].get("dp_size", 1)
    data = {
        "model": {"pretrained_model_name_or_path": "../model", "torch_dtype": "float32",
                  "attn_implementation": "eager", **({"trust_remote_code": True} if is_remote(family) else {})},
        "accelerator": {"device_type": "cpu", "nproc_per_node": world, "nnodes": 1, "tp_size": 1,
                        **LAYOUTS[layout]},
        "codegen": True,
        "training": {"steps": TRAIN_STEPS, "global_batch_size": 2 * dp, "micro_batch_size": 1, "seq_len": 16,
                     "seed": 0},
        "optimizer": {"name": "adamw", "lr": 1.0e-3},
    }
    recipe = project / "recipes" / family_dir(family) / layout / "recipe.yaml"
    recipe.parent.mkdir(parents=True, exist_ok=True)
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    return recipe


def run_generate(project: Path, recipe: Path, timeout: float) -> tuple[int | None, str]:
    """The CLI with --verbose (tracebacks name the exception class); (exit code or None on
    timeout, stdout + stderr)."""
    command = [sys.executable, "-m", "hyper_parallel.codegen", "--verbose", "generate", "--skip-preflight",
               "--config", str(recipe.relative_to(project))]
    try:
        proc = subprocess.run(command, cwd=project, env=clean_env(), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return None, _text(exc.stdout) + _text(exc.stderr)
    return proc.returncode, proc.stdout + proc.stderr


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def failed_stage(output: str) -> str:
    """The first stage that neither finished nor was up to date (the verbose log's lines)."""
    for stage in STAGES[:-1]:
        if not re.search(rf"^(\. {stage} done|-- {stage} up to date)", output, re.M):
            return stage
    return "?"


def final_exception(output: str) -> tuple[str, str]:
    """(class name, message) of the exception that stopped the run: under torchrun the first
    rank's own (``[rankN]: XError: ...``), else the last one a traceback printed (not
    torchrun's ChildFailedError, which only says that a rank failed)."""
    ranked, plain = [], []
    for line in output.splitlines():
        rank = re.match(r"^\[rank\d+\]: ?(.*)$", line)
        text = rank.group(1) if rank else line
        match = EXCEPTION_LINE.match(text) if not text.startswith(" ") else None
        if match and match.group(1).rsplit(".", 1)[-1] != "ChildFailedError":
            (ranked if rank else plain).append((match.group(1).rsplit(".", 1)[-1], match.group(2)))
    found = ranked[:1] or plain[-1:]
    return found[0] if found else ("", "")


def error_message(output: str) -> str:
    """The CLI's own ``error: ...`` text (up to the next blank or indented-fix line)."""
    lines = output.splitlines()
    for index, line in enumerate(lines):
        if line.startswith("error: "):
            return "\n".join([line[len("error: "):], *lines[index + 1:index + 8]])
    return ""


def classify_generate(code: int | None, output: str, project: Path, timeout: float) -> tuple[str, str]:
    """pass / refused / fail and a one-line reason (see the module docstring)."""
    if code == 0:
        return "pass", ""
    if code is None:
        return "fail", f"generate timed out after {timeout:.0f}s in {failed_stage(output)}"
    stage = failed_stage(output)
    kind, _ = final_exception(output)
    message = error_message(output).replace(str(project) + "/", "").replace(str(project), "<project>")
    message = re.sub(r"^recipes/\S+/recipe\.yaml: ", "", message)  # the row names family and layout
    refusal = kind in REFUSAL_ERRORS and (stage in REFUSAL_STAGES or kind == "ProbeError")
    if refusal and code == EXIT_REFUSED:
        return "refused", f"{stage}: {first_line(message, 300)}"
    if refusal:  # a refusal's error class, but the CLI did not report it as one
        return "fail", f"{stage}: {kind} with exit code {code}, not {EXIT_REFUSED}: {first_line(message)}"
    if kind == "VerifyError" or stage == "verify":
        return "fail", f"verify: {verify_reason(message)}"
    label = f"{kind} (exit {code})" if kind else f"exit {code}"
    return "fail", f"{stage}: {label}: {first_line(message)}"


def verify_reason(message: str) -> str:
    """A verify failure in one line: what differed, and where it first diverged or which
    rank's error stopped it."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    head = re.sub(r"^verify failed for \S+ \(world \d+, \w+\) at ", "", lines[0]) if lines else ""
    head = re.sub(r"^verify on \d+ ranks \(\w+\) for \S+ failed:?", "ranks failed:", head)
    # A rank that went silent is reported first; the error of the rank that did fail (its
    # crash usually stopped the other) says more.
    rank_error = next((line for line in lines[1:] if re.match(r"ranks? [\d, ]+: \S", line)), None)
    silent = next((line.split(";")[0] for line in lines[1:] if "went silent" in line), None)
    extra = next((line for line in lines[1:] if line.startswith("first module")), None) \
        or (f"{rank_error} (and {silent})" if rank_error and silent else rank_error) \
        or next((line for line in lines[1:] if not line.startswith("the previous bundle")), "")
    joined = f"{head} {extra}" if head.endswith(":") else f"{head}; {extra}"
    joined = joined.replace(" in  (no plan entry)", " in <root> (no plan entry)")  # the model's own forward
    return first_line(compact_plan_entries(joined if extra else head), 400)


def compact_plan_entries(text: str) -> str:
    """``plan entry 'K': {'role': 'R', ...}`` -> ``plan entry 'K' (role R)``: the dict is in
    the generate log; the role says what the planner thought the module was."""
    out, start = [], 0
    for match in re.finditer(r"plan entry '[^']*': \{", text):
        if match.start() < start:
            continue
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                break
        role = re.search(r"'role': '(\w+)'", text[match.end() - 1:end + 1])
        out.append(text[start:match.start()] + match.group(0)[:-3] + (f" (role {role.group(1)})" if role else ""))
        start = end + 1
    return "".join(out) + text[start:]


def run_training(project: Path, recipe: Path, world: int, timeout: float) -> tuple[str, str]:
    """The gen backend trains TRAIN_STEPS steps under torchrun (the installed bundle, each
    rank reading its checkpoint slices); single-process HF trains the same steps here."""
    metrics = recipe.parent / "metrics.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "-m", "hyper_parallel.trainer", "--config", str(recipe), "--metrics", str(metrics)]
    try:
        proc = subprocess.run(command, cwd=project, env=clean_env(), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "fail", f"train: timed out after {timeout:.0f}s"
    if proc.returncode != 0 or not metrics.is_file():
        return "fail", training_crash(proc.returncode, proc.stdout, proc.stderr, metrics.is_file(), project)
    got = json.loads(metrics.read_text())
    want = reference_training(recipe)
    return compare_training(got, want)


# torchrun's own log lines (``W1201 02:40:35.362000 4953 .../api.py:1028] ...``) and its
# failure report (``Root Cause`` ... ``exitcode  : -6 (pid: 5002)``) around the ranks' output.
TORCHRUN_LOG = re.compile(r"^[WEIF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\] ")
RANK_EXIT = re.compile(r"^\s*rank\s*: (\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*: (-?\d+)", re.M)
RANK_PREFIX = re.compile(r"^\[rank\d+\]:")
STEP_LINE = re.compile(r"^step (\d+)/(\d+) \|", re.M)


def exit_text(code: int) -> str:
    """``exit 1``, or ``killed by SIGABRT (exit -6)`` for a negative (signal) code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit {code})"
        except ValueError:
            return f"killed by signal {-code} (exit {code})"
    return f"exit {code}"


def rank_exits(stderr: str) -> list[tuple[int, int]]:
    """(rank, exit code) from torchrun's failure report, the root cause first (torchrun
    lists the other failures first, then ``Root Cause (first observed failure)``)."""
    cause = stderr.rfind("Root Cause")
    found = [(int(rank), int(code)) for rank, code in RANK_EXIT.findall(stderr[cause:] if cause >= 0 else "")]
    for rank, code in RANK_EXIT.findall(stderr[:cause] if cause >= 0 else stderr):
        if (int(rank), int(code)) not in found:
            found.append((int(rank), int(code)))
    return found


def rank_stderr_lines(stderr: str) -> list[str]:
    """The ranks' own stderr lines: torchrun's log lines and its closing traceback and
    failure report (from the launcher's ``Traceback`` that ends in ChildFailedError) left out."""
    lines = stderr.splitlines()
    failed = next((i for i, line in enumerate(lines) if "ChildFailedError" in line), None)
    if failed is not None:
        start = next((i for i in range(failed, -1, -1) if lines[i].startswith("Traceback (most recent call last)")),
                     failed)
        lines = lines[:start]
    return [line.strip() for line in lines if line.strip() and not TORCHRUN_LOG.match(line)]


def training_crash(code: int, stdout: str, stderr: str, metrics_written: bool, project: Path) -> str:
    """Why the training launch failed, never empty: torchrun's exit code, the rank that
    failed first and how (signal names for negative codes), how far training got, and the
    rank's exception or else the last lines of the ranks' stderr."""
    parts = [f"torchrun {exit_text(code)}" if code else "torchrun exit 0 but rank 0 wrote no metrics"]
    exits = rank_exits(stderr)
    if exits:
        rank, rank_code = exits[0]
        parts.append(f"rank {rank} {exit_text(rank_code)}"
                     + (f" (also {', '.join(f'rank {r} {exit_text(c)}' for r, c in exits[1:])})" if exits[1:] else ""))
    steps = STEP_LINE.findall(stdout)
    if steps:
        done, total = steps[-1]
        parts.append(f"after step {done}/{total}" + (", metrics written" if metrics_written else ""))
    kind, message = final_exception(stdout + "\n" + stderr)
    lines = rank_stderr_lines(stderr)
    # A rank killed by a signal prints no traceback; what it printed last (e.g. "terminate
    # called without an active exception") says more than the others' "connection closed".
    unranked = [line for line in lines if not RANK_PREFIX.match(line)]
    if exits and exits[0][1] < 0 and unranked:
        detail = " | ".join(unranked[-3:])
    elif kind:
        detail = f"{kind}: {message}"
    else:
        tail = lines[-3:] or [line.strip() for line in stdout.splitlines() if line.strip()][-2:]
        detail = " | ".join(tail) if tail else "no output"
    detail = detail.replace(str(project) + "/", "").replace(str(project), "<project>")
    return first_line(f"train (gen backend) crashed: {'; '.join(parts)}: {detail}", 400)


def compare_training(got: list[dict], want: list[dict]) -> tuple[str, str]:
    """Loss rtol LOSS_RTOL and gradient norm rtol NORM_RTOL at every step."""
    if len(got) != len(want):
        return "fail", f"train: {len(got)} steps logged, expected {len(want)}"
    worst_loss = worst_norm = 0.0
    for step, (have, ref) in enumerate(zip(got, want), start=1):
        loss_rel = abs(have["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12)
        norm_rel = abs(have["grad_norm"] - ref["grad_norm"]) / max(abs(ref["grad_norm"]), 1e-12)
        worst_loss, worst_norm = max(worst_loss, loss_rel), max(worst_norm, norm_rel)
        if not math.isfinite(have["loss"]) or loss_rel > LOSS_RTOL or norm_rel > NORM_RTOL:
            return "fail", (f"train step {step}: loss {have['loss']:.7g} vs one process {ref['loss']:.7g} "
                            f"(rel {loss_rel:.1e}), grad norm {have['grad_norm']:.6g} vs {ref['grad_norm']:.6g} "
                            f"(rel {norm_rel:.1e})")
    return "pass", f"train {len(got)} steps: loss rel <= {worst_loss:.0e}, grad norm rel <= {worst_norm:.0e}"


def run_case(project: Path, case: Case, args) -> Case:
    """Generate (with verify), then train when it generated."""
    recipe = write_recipe(project, case.family, case.layout)
    start = time.perf_counter()
    code, output = run_generate(project, recipe, args.timeout)
    case.generate_s = time.perf_counter() - start
    case.status, case.reason = classify_generate(code, output, project, args.timeout)
    (recipe.parent / "generate.log").write_text(output)
    if case.status == "pass" and not args.no_train:
        start = time.perf_counter()
        case.status, case.reason = run_training(project, recipe, world_of(case.layout), args.timeout)
        case.train_s = time.perf_counter() - start
    return case


# --- peer column: transformers' tp_plan="auto" at tp2 --------------------------------------------


def run_peer(project: Path, families: list[str], timeout: float) -> dict[str, tuple[str, str]]:
    """{family: (status, reason)}. Families without a base_model_tp_plan are "unsupported";
    the rest run in as few torchrun launches as the failures allow."""
    results, cases = {}, []
    for family in families:
        model_dir = project / "recipes" / family_dir(family) / "model"
        config = transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=is_remote(family))
        if not getattr(config, "base_model_tp_plan", None):
            results[family] = ("unsupported", "the config has no base_model_tp_plan")
        else:  # the worker names its files after "family": no ":" in it; "name" is the row's
            cases.append({"family": family_dir(family), "model_dir": str(model_dir),
                          "trust_remote_code": is_remote(family), "name": family})
    out = project / "peer"
    out.mkdir(exist_ok=True)
    while cases:
        start = time.perf_counter()
        tail = launch_peer(cases, out, timeout * len(cases))
        for case in list(cases):
            family, files = case["name"], case["family"]
            result = read_peer_result(out, files)
            if result is None and (out / f"{files}.started").is_file():
                result = {"error": f"the launch ended in this case: {tail or 'timed out'}"}
            if result is None:
                break  # not reached: the next launch runs it
            results[family] = judge_peer(result)
            cases.remove(case)
            progress(f"peer {family}: {results[family][0]}", time.perf_counter() - start)
    return results


def launch_peer(cases: list[dict], out: Path, timeout: float) -> str:
    """One torchrun (world 2) over ``cases``; returns the last error line when it failed."""
    for path in out.glob("*.started"):
        path.unlink()
    (out / "cases.json").write_text(json.dumps(cases, indent=1))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
               "--cases", str(out / "cases.json"), "--out", str(out)]
    try:
        proc = subprocess.run(command, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f}s"
    if proc.returncode == 0:
        return ""
    kind, message = final_exception(proc.stdout + proc.stderr)
    return first_line(f"{kind}: {message}") if kind else f"torchrun exit {proc.returncode}"


def read_peer_result(out: Path, family: str) -> dict | None:
    """Rank 0's result, or any rank's error."""
    results = [json.loads(path.read_text()) for path in sorted(out.glob(f"{family}.rank*.json"))]
    errors = [r for r in results if "error" in r]
    return errors[0] if errors else (results[0] if results else None)


def judge_peer(result: dict) -> tuple[str, str]:
    """pass when the peer really sharded (tp 2) and matched one process at every step."""
    if "error" in result:
        return "fail", first_line(result["error"])
    if result.get("tp_size") != 2 or not result.get("sharded"):
        return "unsupported", f"tp_plan='auto' sharded nothing (tp_size {result.get('tp_size')})"
    status, reason = compare_training(result["peer"], result["reference"])
    return status, reason.replace("train", "tp_plan='auto'", 1)


# --- reporting ---------------------------------------------------------------------------------


def progress(message: str, seconds: float) -> None:
    print(f"[{seconds:6.1f}s] {message}", file=sys.stderr, flush=True)


def layouts_for(family: str, moe: bool, layouts: list[str]) -> list[str]:
    """The requested layouts that apply: ep layouts only for MoE families."""
    return [layout for layout in layouts if moe or layout not in MOE_LAYOUTS]


def summary_line(cases: list[Case], peer: dict, kept: int | None, skipped: int, run_note: str,
                 remote: int = 0) -> str:
    """``families: N kept (M skipped); tp2 pass X/R (P%), ...; remote-code fixtures: K; tp2
    pass ...; zero-fail: yes/no; transformers V``. transformers' families and the remote-code
    fixtures are counted apart; ``kept`` None: transformers' families were not enumerated
    (--remote-only)."""
    sections = []
    for label, ours, count in (("families", lambda f: not is_remote(f), kept),
                               ("remote-code fixtures", is_remote, remote if remote else None)):
        if count is None:
            continue
        parts = pass_counts([c for c in cases if ours(c.family)])
        their_peer = [status for family, (status, _) in peer.items() if ours(family)]
        if their_peer:
            parts.append(f"peer tp2 pass {their_peer.count('pass')}/{len(their_peer)}")
        head = f"{label}: {count} kept ({skipped} skipped)" if label == "families" else f"{label}: {count}"
        sections.append("; ".join([head, ", ".join(parts)] if parts else [head]))
    zero_fail = "yes" if not any(c.status == "fail" for c in cases) else "no"
    return f"{'; '.join(sections)}; zero-fail: {zero_fail}; transformers {transformers.__version__}{run_note}"


def pass_counts(cases: list[Case]) -> list[str]:
    """``tp2 pass X/R (P%)`` per layout that has rows."""
    parts = []
    for layout in LAYOUTS:
        rows = [c for c in cases if c.layout == layout]
        if rows:
            passed = sum(c.status == "pass" for c in rows)
            parts.append(f"{layout} pass {passed}/{len(rows)} ({100 * passed / len(rows):.0f}%)")
    return parts


def status_cell(case: Case | None) -> str:
    return "" if case is None else {"pass": "pass", "refused": "refused", "fail": "**FAIL**"}[case.status]


def result_table(families: list[str], layouts: list[str], cases: list[Case], peer: dict, moe: dict) -> list[str]:
    """Markdown: family x layout -> status, and the peer column ("n/a": layout does not apply)."""
    by_key = {(c.family, c.layout): c for c in cases}
    header = ["family", "moe", *layouts] + (["peer tp2"] if peer else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for family in families:
        cells = [family, "yes" if moe[family] else ""]
        for layout in layouts:
            applies = moe[family] or layout not in MOE_LAYOUTS
            cells.append(status_cell(by_key.get((family, layout))) if applies else "n/a")
        if peer:
            cells.append(peer.get(family, ("", ""))[0])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def print_report(families, layouts, cases, peer, moe, summary) -> None:
    """The table and every non-pass row's reason on stdout, then the summary line."""
    width = max(len(f) for f in families)
    print(f"{'family':{width}}  " + "  ".join(f"{name:9}" for name in [*layouts, *(["peer"] if peer else [])]))
    by_key = {(c.family, c.layout): c for c in cases}
    for family in families:
        cells = [(by_key[(family, l)].status if (family, l) in by_key else "n/a") for l in layouts]
        if peer:
            cells.append(peer[family][0])
        print(f"{family:{width}}  " + "  ".join(f"{cell:9}" for cell in cells))
    for case in cases:
        if case.status != "pass":
            print(f"  {case.status:7} {case.family} {case.layout}: {case.reason}")
    for family, (status, reason) in peer.items():
        if status != "pass":
            print(f"  peer {status} {family}: {reason}")
    print(summary)


def write_docs(md_path: Path, json_path: Path | None, *, families, layouts, cases, peer, moe, skipped, summary,
               command: str, partial: str) -> None:
    """docs/families.md and the JSON (exactly transformers / rows / peer / skipped)."""
    data = {
        "transformers": transformers.__version__,
        "rows": [{"family": c.family, "layout": c.layout, "status": c.status, "reason": c.reason} for c in cases],
        "peer": [{"family": f, "status": peer[f][0]} for f in families if f in peer],
        "skipped": [{"family": f, "reason": r} for f, r in sorted(skipped.items())],
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=1) + "\n")
    if md_path is not None:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(docs_markdown(families, layouts, cases, peer, moe, skipped, summary, command, partial))


def docs_markdown(families, layouts, cases, peer, moe, skipped, summary, command, partial) -> str:
    """The page: how it was made and what it means, then the tables."""
    return "\n".join([*docs_header(summary, command, partial, cases, peer),
                      *docs_tables(families, layouts, cases, peer, moe, skipped)]) + "\n"


def docs_header(summary, command, partial, cases, peer) -> list[str]:
    """Provenance, the partial-run note, the summary and the meaning of each status."""
    lines = [
        "# Decoder families: generate, verify and train per layout",
        "",
        f"Written by `{command}` (transformers {transformers.__version__}, torch {torch.__version__.split('+')[0]}, "
        f"CPU, gloo). The full sweep is `{REGENERATE}`; the bench's docstring says what is measured.",
        "",
    ]
    if partial:
        lines += [f"> **Partial run.** {partial} Families and layouts not listed below were not run.", ""]
    lines += [f"**Summary:** {summary}", ""]
    behind = sorted({c.family for c in cases if c.layout == "tp2" and c.status != "pass"
                     and peer.get(c.family, ("",))[0] == "pass"})
    if behind:
        lines += [f"Families where transformers' own tp2 equals one process and ours does not pass tp2 "
                  f"({len(behind)}): {', '.join(behind)}.", ""]
    return lines + [
        "Each row: a tiny random-weight checkpoint of the family (transformers' `save_pretrained`: its real "
        "tensor names), a recipe with the layout, `python -m hyper_parallel.codegen generate` (its verify stage "
        "runs the bundle at the recipe's world size against one process on a shrunk probe: 2 AdamW steps, loss "
        f"rtol 1e-5, every gradient rtol 1e-4), then, if it generated, {TRAIN_STEPS} AdamW steps with the gen "
        "backend under torchrun from the checkpoint against single-process HF on the same batches (loss rtol "
        "1e-5, gradient norm rtol 1e-4, every step).",
        "",
        "- **pass**: generated, verified, and trained equal to one process;",
        "- **refused**: generate stopped (exit code 2) with one of the project's own errors (resolve, derive, "
        "freeze, or verify's probe), naming what it cannot plan;",
        "- **FAIL**: anything else: a verify mismatch, a crash in a stage or in verify's ranks, a training "
        "mismatch or crash (e.g. the checkpoint does not load), a timeout;",
        "- **peer tp2**: the same checkpoint through transformers' `from_pretrained(dir, tp_plan=\"auto\")` at "
        f"tp 2 (world 2) against one process, {TRAIN_STEPS} AdamW steps (loss rtol 1e-5, gradient norm rtol "
        "1e-4): pass / fail / unsupported (no `base_model_tp_plan`);",
        "- layouts: `tp2`; `tp2_sp_lp` = tp2 + sequence parallel + loss parallel; `cp2`; `dp2` (FSDP2); for MoE "
        "families `ep2` (dp2 + ep2, world 2) and `tp2_ep2` (tp2 + dp2 + ep2, world 4) — ep is borrowed from "
        "dp x cp; `n/a`: the layout does not apply;",
        "- `remote:<name>`: a decoder transformers does not ship, from the project's remote-code fixtures "
        "(`tests/data/remote_code/<name>`: `auto_map`, its own configuration and modeling files; module names "
        "and block structures of no transformers family); its config.json is the tiny config and its recipes "
        "set `model.trust_remote_code: true`.",
        "",
    ]


def docs_tables(families, layouts, cases, peer, moe, skipped) -> list[str]:
    """Family x layout, every non-pass reason, the peer's details, the skipped types."""
    lines = ["## Results", "", *result_table(families, layouts, cases, peer, moe), ""]
    problems = [c for c in cases if c.status != "pass"]
    if problems:
        lines += ["## Refusals and failures", "", "| family | layout | status | reason |", "|---|---|---|---|"]
        lines += [f"| {c.family} | {c.layout} | {c.status} | {md_cell(c.reason)} |" for c in problems]
        lines.append("")
    if peer:
        lines += ["## Peer (transformers tp_plan=\"auto\", tp2)", "", "| family | status | detail |", "|---|---|---|"]
        lines += [f"| {f} | {peer[f][0]} | {md_cell(peer[f][1])} |" for f in families if f in peer]
        lines.append("")
    if not skipped:  # --remote-only: transformers' families were not enumerated
        return lines
    lines += [f"## Skipped types ({len(skipped)})", "",
              "Types of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` that are not attention-based decoder-only text LMs "
              "(or cannot be built offline):", "", "| type | reason |", "|---|---|"]
    return lines + [f"| {f} | {md_cell(r)} |" for f, r in sorted(skipped.items())]


def md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# --- command line ------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", help=f"comma-separated model types and {REMOTE_PREFIX}<fixture> names "
                                            "(default: every kept family and every remote-code fixture)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"comma-separated, of {', '.join(LAYOUTS)} (default: all; ep layouts only for MoE)")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at a time (default 1)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per generate / training run / peer case")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON here")
    parser.add_argument("--no-docs", action="store_true", help="don't write docs/families.md and docs/families.json")
    parser.add_argument("--keep", metavar="DIR", help="build the throwaway project here and keep it")
    parser.add_argument("--list", action="store_true",
                        help="print kept and skipped families and the remote-code fixtures, run nothing")
    parser.add_argument("--no-train", action="store_true", help="skip the gen-backend training after generate")
    parser.add_argument("--no-peer", action="store_true", help="skip the transformers tp_plan='auto' column")
    parser.add_argument("--remote-only", action="store_true",
                        help=f"run only the remote-code fixtures ({REMOTE_PREFIX}<folder> of tests/data/remote_code)")
    return parser.parse_args()


def select(args, kept: list[str], skipped: dict[str, str], remote: list[str]) -> tuple[list[str], list[str]]:
    """The families and layouts asked for, checked against what exists: transformers'
    families first, then the remote-code fixtures (only those with --remote-only)."""
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        sys.exit(f"--layouts: unknown {unknown}; known: {', '.join(LAYOUTS)}")
    layouts = [name for name in LAYOUTS if name in layouts]
    if not args.families:
        return (remote if args.remote_only else kept + remote), layouts
    families = sorted({name.strip() for name in args.families.split(",") if name.strip()},
                      key=lambda name: (is_remote(name), name))
    for family in families:
        if is_remote(family):
            if family not in remote:
                sys.exit(f"--families: {family} is not a remote-code fixture; fixtures: {', '.join(remote)}")
        elif args.remote_only:
            sys.exit(f"--families: {family} is not a remote-code fixture (--remote-only); fixtures: "
                     f"{', '.join(remote)}")
        elif family in skipped:
            sys.exit(f"--families: {family} is skipped: {skipped[family]}")
        elif family not in kept:
            sys.exit(f"--families: {family} is not a model type of the causal-LM mapping")
    return families, layouts


def partial_note(args, families: list[str], layouts: list[str], kept: list[str]) -> str:
    """Empty for the full sweep; otherwise what this run covered."""
    notes = []
    remote = remote_families()
    if args.remote_only:
        notes.append(f"Ran only remote-code fixtures (--remote-only), {len(families)} of {len(remote)}: "
                     f"{', '.join(families)}; transformers' families were not run.")
    elif families != kept + remote:
        hf = [family for family in families if not is_remote(family)]
        ours = [family for family in families if is_remote(family)]
        notes.append(f"Ran {len(hf)} of {len(kept)} kept families"
                     f"{': ' + ', '.join(hf) if hf and hf != kept else ''}, and {len(ours)} of {len(remote)} "
                     f"remote-code fixtures{': ' + ', '.join(ours) if ours and ours != remote else ''}.")
    if layouts != list(LAYOUTS):
        notes.append(f"Layouts run: {', '.join(layouts)} (of {', '.join(LAYOUTS)}).")
    if args.no_train:
        notes.append("Gen-backend training was not run (--no-train): pass means generated and verified.")
    if args.no_peer:
        notes.append("The peer column was not run (--no-peer).")
    return " ".join(notes)


def command_line(args) -> str:
    """The command as it affects the results (no paths, no --jobs)."""
    parts = [REGENERATE]
    if args.remote_only:
        parts.append("--remote-only")
    if args.families:
        parts.append(f"--families {args.families}")
    if args.layouts != ",".join(LAYOUTS):
        parts.append(f"--layouts {args.layouts}")
    parts += [flag for flag, on in (("--no-train", args.no_train), ("--no-peer", args.no_peer)) if on]
    return " ".join(parts)


def prepare(project: Path, families: list[str]) -> dict[str, bool]:
    """Checkpoints for every family; {family: is MoE}."""
    moe = {}
    for family in families:
        start = time.perf_counter()
        save_checkpoint(family, project / "recipes" / family_dir(family) / "model")
        moe[family] = is_moe(tiny_config(family))
        progress(f"checkpoint {family}{' (MoE)' if moe[family] else ''}", time.perf_counter() - start)
    return moe


def run_cases(project: Path, cases: list[Case], args) -> None:
    """Every case, ``--jobs`` at a time; a progress line per case as it finishes."""
    def one(case: Case) -> Case:
        run_case(project, case, args)
        detail = f": {case.reason}" if case.status != "pass" else ""
        progress(f"{case.family} {case.layout}: {case.status}{detail} (generate {case.generate_s:.1f}s, "
                 f"train {case.train_s:.1f}s)", case.generate_s + case.train_s)
        return case

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, cases))


def print_timings(cases: list[Case]) -> None:
    """Mean seconds per case by layout, to plan a full sweep."""
    for layout in LAYOUTS:
        rows = [c for c in cases if c.layout == layout]
        if rows:
            gen = sum(c.generate_s for c in rows) / len(rows)
            trained = [c.train_s for c in rows if c.train_s]
            train = sum(trained) / len(trained) if trained else 0.0
            print(f"timing {layout}: {len(rows)} case(s), generate {gen:.1f}s mean, train {train:.1f}s mean "
                  f"({len(trained)} trained)")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # --remote-only does not enumerate transformers' families (it builds a meta model of each)
    kept, skipped = ([], {}) if args.remote_only else enumerate_families()
    remote = remote_families()
    if args.list:
        if not args.remote_only:
            print(f"kept ({len(kept)}): {' '.join(kept)}")
        print(f"remote-code fixtures ({len(remote)}): {' '.join(remote)}")
        if not args.remote_only:
            print(f"skipped ({len(skipped)}):")
            for family, reason in skipped.items():
                print(f"  {family}: {reason}")
        return
    families, layouts = select(args, kept, skipped, remote)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="family_sweep_") as tmp:
        project = make_project(Path(args.keep).resolve() if args.keep else Path(tmp) / "project")
        moe = prepare(project, families)
        cases = [Case(family, layout) for family in families for layout in layouts_for(family, moe[family], layouts)]
        run_cases(project, cases, args)
        peer = {} if args.no_peer else run_peer(project, families, args.timeout)
    note = partial_note(args, families, layouts, kept)
    summary = summary_line(cases, peer, None if args.remote_only else len(kept), len(skipped),
                           "; partial run" if note else "", remote=len(remote))
    print_report(families, layouts, cases, peer, moe, summary)
    print_timings(cases)
    print(f"total {time.perf_counter() - started:.0f}s")
    report = dict(families=families, layouts=layouts, cases=cases, peer=peer, moe=moe, skipped=skipped,
                  summary=summary, command=command_line(args), partial=note)
    if args.json:
        write_docs(None, Path(args.json), **report)
    if not args.no_docs:
        write_docs(DOCS_MD, DOCS_JSON, **report)


if __name__ == "__main__":
    main()
