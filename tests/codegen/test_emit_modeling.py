"""emit.modeling: the generated Qwen3-MoE modeling file (DESIGN §6).

The emitted file must differ from the HF source only by the intended edits, be
deterministic, import, and build a model that computes what the HF model computes.
"""

import difflib
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hyper_parallel.codegen.emit.modeling import emit_modeling_source
from hyper_parallel.runtime import REPLACED_RECORD, hyper_apply_replacements
from hyper_parallel.config.plan_override import TRUSTED_PACKAGE, parse_plan_overrides
from hyper_parallel.distributed.plan_format import plan_from_json
from hyper_parallel.models.qwen3_moe.adapter.replacements import (
    Qwen3MoeFusedAttention,
    replace_qwen3_moe_flash_attention,
)

SOURCE_MODULE = "transformers.models.qwen3_moe.modeling_qwen3_moe"
TINY_CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipes/tiny_cpu/models/tiny-qwen3-moe"
BANNER = {
    "recipe": "recipes/tiny_cpu/qwen3_moe.yaml",
    "transformers_version": "5.x",
    "parallel_dims": {"dp": 1, "tp": 2, "cp": 1, "ep": 1, "pp": 1, "sequence_parallel": True},
}
PLAN = {
    "format": 2,
    "layout": {"dp": 1, "cp": 1, "tp": 2, "ep": 1, "pp": 1, "sequence_parallel": True, "loss_parallel": False},
    "applied_axes": ["tp"],
    "recorded_axes": {"pp": "pipeline splitting belongs to the trainer"},
    "modules": {
        "model.layers.*.self_attn.q_proj": {
            "role": "colwise", "state_shardings": {"weight": {"tp": "shard(0)"}},
            "in_src": None, "in_dst": None, "out_src": [{"tp": "shard(-1)"}], "out_dst": None,
            "local_map": False,
        },
        "lm_head": {
            "role": "colwise", "state_shardings": {"weight": {"tp": "shard(0)"}},
            "in_src": [{"tp": "shard(1)"}], "in_dst": [{"tp": "replicate"}], "out_src": None,
            "out_dst": None, "local_map": True,
        },
    },
}
FUSED_ATTENTION = "hyper_parallel.models.qwen3_moe.adapter.replacements.replace_qwen3_moe_flash_attention"
ATTENTION_TYPE = f"{SOURCE_MODULE}.Qwen3MoeAttention"
APPLY_LINE = "hyper_parallel_runtime.hyper_apply_replacements(self, HYPER_REPLACEMENTS)"

calls: list[str] = []


def counting_fused_attention(module, **kwargs):
    """A replace_module target that counts its calls (imported by dotted path)."""
    calls.append(type(module).__qualname__)
    return replace_qwen3_moe_flash_attention(module, **kwargs)


def hf_source() -> str:
    return Path(importlib.util.find_spec(SOURCE_MODULE).origin).read_text(encoding="utf-8")


def replacing(*entries: dict) -> tuple:
    """Recipe entries ``{match, module_type?, replace_module}`` as the loader hands them on;
    factories here are trusted."""
    return parse_plan_overrides(list(entries), trusted=(TRUSTED_PACKAGE, __name__.partition(".")[0]))


def emit(overrides=(), plan=PLAN, banner=BANNER) -> str:
    return emit_modeling_source(source_text=hf_source(), source_module=SOURCE_MODULE, banner=dict(banner),
                                frozen_plan=plan, overrides=replacing(*overrides))


@pytest.fixture
def import_generated(tmp_path):
    """Import emitted text as a module (tests only; the real loader is codegen.loader)."""
    names = []

    def load(text: str, stem: str = "modeling_Qwen3_Moe_gen_cpu"):
        path = tmp_path / f"{stem}.py"
        path.write_text(text, encoding="utf-8")
        name = f"_hyper_test_generated_{len(names)}_{stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # classes look up their module (HYPER_SOURCE_MODULE) here
        names.append(name)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in names:
        sys.modules.pop(name, None)


def tiny_config(attn_implementation: str = "eager"):
    config = AutoConfig.from_pretrained(TINY_CONFIG_DIR)
    config._attn_implementation = attn_implementation
    return config


def hf_model(config):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def _absolute(line: str) -> str:
    m = re.match(r"(\s*from )(\.+[\w.]*)( import.*)", line, re.S)
    return m.group(1) + importlib.util.resolve_name(m.group(2), "transformers.models.qwen3_moe") + m.group(3)


def test_only_the_intended_hunks_differ_and_comments_survive():
    original = hf_source().splitlines(keepends=True)
    generated = emit([{"match": "*.self_attn", "module_type": ATTENTION_TYPE,
                       "replace_module": {"_target_": FUSED_ATTENTION}}])
    lines = generated.splitlines(keepends=True)
    opcodes = difflib.SequenceMatcher(a=original, b=lines, autojunk=False).get_opcodes()
    changes = [op for op in opcodes if op[0] != "equal"]
    assert not [op for op in changes if op[0] == "delete"]

    banner, *middle, tail = changes
    assert banner[:2] == ("replace", 0)  # transformers' modular banner gives way to ours
    assert "automatically generated from" in "".join(original[:banner[2]]) and banner[2] <= 8
    assert all(line.startswith("#") or line == "\n" for line in lines[banner[3]:banner[4]])
    assert "".join(lines).count("Generated by hyper-parallel codegen") == 1
    assert "automatically generated from" not in "".join(lines)
    assert tail[0] == "insert" and tail[1] == len(original)
    inserted = []
    for tag, a0, a1, b0, b1 in middle:
        if tag == "replace":  # relative imports, each made absolute in place (+ inserted lines)
            assert [_absolute(line) for line in original[a0:a1]] == lines[b0:b0 + a1 - a0]
            b0 += a1 - a0
        else:
            assert tag == "insert"
        inserted += [line.strip() for line in lines[b0:b1] if line.strip()]
    code = [line for line in inserted if not line.startswith("#")]
    assert code[0] == "from hyper_parallel import runtime as hyper_parallel_runtime"
    assert code[1] == "HYPER_REPLACEMENTS = [" and code[-3] == "]"  # defined before the classes use it
    assert code[-2:] == [APPLY_LINE, APPLY_LINE]
    assert sum("hyper_parallel" in line and "import" in line for line in lines) == 1  # one runtime import

    comments = [line for line in original[banner[2]:] if line.lstrip().startswith("#")]
    remaining = iter(lines[banner[4]:])
    assert all(comment in remaining for comment in comments)  # in order, none lost
    assert "from ." not in "".join(lines)
    assert "from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig\n" in lines
    assert "from transformers import initialization as init\n" in lines


def test_replacement_call_sits_right_before_post_init_in_both_model_classes():
    lines = emit([{"match": "*.self_attn", "replace_module": {"_target_": FUSED_ATTENTION}}]).splitlines()
    before_post_init = [lines[i - 1] for i, line in enumerate(lines) if line.strip() == "self.post_init()"]
    assert before_post_init == ["        " + APPLY_LINE] * 2


def test_without_replacements_nothing_is_inserted_in_init():
    text = emit()
    assert "hyper_apply_replacements" not in text
    assert "HYPER_REPLACEMENTS" not in text


def test_output_is_deterministic_and_compiles():
    overrides = [{"match": "*.self_attn", "module_type": ATTENTION_TYPE,
                  "replace_module": {"_target_": FUSED_ATTENTION, "b": 1, "a": [1, 2]}}]
    first, second = emit(overrides), emit(overrides)
    assert first == second
    assert first.index('"a": [') < first.index('"b": 1')  # kwargs sorted by name
    compile(first, "generated.py", "exec")


def test_banner_names_inputs_axes_and_what_the_runtime_owns():
    head = emit().split("\n\n", 1)[0]
    flat = " ".join(line[1:].strip() for line in head.splitlines())
    for expected in ("Generated by hyper-parallel codegen", "doit generate config=<that recipe>",
                     "the recipe recipes/tiny_cpu/qwen3_moe.yaml (relative to this folder)",
                     f"From {SOURCE_MODULE} (transformers 5.x)", "codegen_meta.json",
                     "dp=1 tp=2 cp=1 ep=1 pp=1 sequence_parallel=True", "applied: tp",
                     "recorded only: pp (pipeline splitting belongs to the trainer)", "FSDP2",
                     "activation checkpointing", "torch.compile", "running the pipeline stages (the plan records the split)"):
        assert expected in flat
    assert all(line.startswith("#") for line in head.splitlines())
    assert not re.search(r"[0-9a-f]{16}", head)  # no signature or sha256: those live in codegen_meta.json


def test_banner_and_plan_errors_name_the_key():
    with pytest.raises(ValueError, match=r"banner\.recipe: expected a relative path.*'/abs/r\.yaml'"):
        emit(banner={**BANNER, "recipe": "/abs/r.yaml"})
    with pytest.raises(ValueError, match=r"banner: missing keys \['transformers_version'\]"):
        emit(banner={k: v for k, v in BANNER.items() if k != "transformers_version"})
    with pytest.raises(ValueError, match=r"frozen_plan\.format: expected 2, got 1"):
        emit(plan={**PLAN, "format": 1})


def test_plan_is_a_readable_literal_that_round_trips(import_generated):
    text = emit()
    # one line per key; defaults omitted; a redistribution written as "src -> dst"
    assert ('    "modules": {\n        "model.layers.*.self_attn.q_proj": "colwise | weight: tp=shard(0) | '
            'out: tp=shard(-1) -> -",\n') in text  # an explicit null dst stays
    assert '"lm_head": "colwise | weight: tp=shard(0) | in: tp=shard(1) -> tp=replicate | local_map",\n' in text
    assert "# roles:\n#   colwise  weight split by output rows" in text  # the legend
    assert "\ndef hyper_parallelize(model, mesh_context):\n" in text
    module = import_generated(text)
    assert plan_from_json(module.HYPER_PARALLEL_PLAN) == plan_from_json(PLAN)  # the same plan, decoded
    assert module.HYPER_SOURCE_MODULE == SOURCE_MODULE


def test_generated_model_matches_hf_logits(import_generated):
    module = import_generated(emit())
    config = tiny_config()
    reference = hf_model(config)
    generated = module.Qwen3MoeForCausalLM(config).eval()
    assert type(generated).__module__ == module.__name__
    generated.load_state_dict(reference.state_dict())
    input_ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits(generated, input_ids), logits(reference, input_ids), rtol=0, atol=0)


def test_generated_model_applies_each_replacement_exactly_once(import_generated):
    overrides = [{"match": "*.self_attn", "module_type": ATTENTION_TYPE,
                  "replace_module": {"_target_": f"{__name__}.counting_fused_attention"}}]
    module = import_generated(emit(overrides))
    config = tiny_config()
    calls.clear()
    generated = module.Qwen3MoeForCausalLM(config).eval()

    assert calls == ["Qwen3MoeAttention"] * config.num_hidden_layers
    assert all(isinstance(layer.self_attn, Qwen3MoeFusedAttention) for layer in generated.model.layers)
    # The base model's __init__ replaced the layers; the head's call found them done.
    assert getattr(generated.model, REPLACED_RECORD) == {
        f"layers.{i}.self_attn": f"{__name__}.counting_fused_attention" for i in range(config.num_hidden_layers)}
    assert getattr(generated, REPLACED_RECORD) == {}
    assert hyper_apply_replacements(generated, module.HYPER_REPLACEMENTS) == 0
    assert len(calls) == config.num_hidden_layers

    reference = hf_model(config)
    assert generated.state_dict().keys() == reference.state_dict().keys()
    generated.load_state_dict(reference.state_dict())
    input_ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(logits(generated, input_ids), logits(reference, input_ids), rtol=1e-5, atol=1e-5)


def test_generated_model_with_replacements_builds_on_meta(import_generated):
    module = import_generated(emit([{"match": "*.self_attn", "module_type": ATTENTION_TYPE,
                                     "replace_module": {"_target_": FUSED_ATTENTION}}]))
    with torch.device("meta"):
        generated = module.Qwen3MoeForCausalLM(tiny_config())
    assert isinstance(generated.model.layers[1].self_attn, Qwen3MoeFusedAttention)
    assert generated.model.layers[1].self_attn.q_proj.weight.is_meta


def test_synthetic_source_edits_are_exact_and_keep_layout():
    source = (
        "# 🚨 header\n"
        "from ...utils import (  # why\n"
        "    a,  # keep\n"
        ")\n"
        "from .configuration_x import XConfig\n"
        "\n"
        "\n"
        "class XModel(Base):\n"
        "    def __init__(self, config):\n"
        "        super().__init__(config)\n"
        "        # Initialize weights\n"
        "        self.post_init()  # trailing\n"
    )
    text = emit_modeling_source(source_text=source, source_module="transformers.models.x.modeling_x",
                                banner=BANNER, frozen_plan=PLAN,
                                overrides=replacing({"match": "*.attn",
                                                     "replace_module": {"_target_": FUSED_ATTENTION}}))
    body = text[text.index("# 🚨 header"):text.index("\n\n# ----")]
    assert body == (
        "# 🚨 header\n"
        "from transformers.utils import (  # why\n"
        "    a,  # keep\n"
        ")\n"
        "from transformers.models.x.configuration_x import XConfig\n"
        "\n"
        "from hyper_parallel import runtime as hyper_parallel_runtime\n"
        "\n"
        "\n"
        "# The recipe's replace_module entries; every model __init__ applies them before\n"
        "# self.post_init(), so training sees the structure the plan was derived on.\n"
        "HYPER_REPLACEMENTS = [\n"
        '    {\n        "match": "*.attn",\n'
        f'        "target": "{FUSED_ATTENTION}",\n'
        "    },\n]\n"
        "\n"
        "\n"
        "class XModel(Base):\n"
        "    def __init__(self, config):\n"
        "        super().__init__(config)\n"
        "        # Initialize weights\n"
        f"        {APPLY_LINE}\n"
        "        self.post_init()  # trailing\n"
    )


def test_replacements_need_a_post_init_to_hook_into():
    with pytest.raises(ValueError, match=r"no class __init__ calls self\.post_init\(\)"):
        emit_modeling_source(source_text="import torch\n\nclass A:\n    pass\n", source_module="pkg.mod",
                             banner=BANNER, frozen_plan=PLAN,
                             overrides=replacing({"match": "*", "replace_module": {"_target_": f"{__name__}.b"}}))
