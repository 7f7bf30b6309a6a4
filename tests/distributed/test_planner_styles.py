"""transformers' tensor-parallel styles read by meaning (issue 11, fault class 1: hints read by
name, not meaning).

Every style transformers registers is mapped to a role or refused with a reason, and what
the table says each one means agrees with what transformers' own style objects do to
inputs, outputs and parameters. The planner uses a hint only where it agrees with the
module it sits on and with that module's neighbours; a style it does not know, or one
no role means, stops planning with the module, the style and a plan_overrides entry
that places the module instead.
"""

import pytest
import torch
import torch.distributed as dist
import transformers
import transformers.distributed.expert_parallel  # noqa: F401  (registers the expert-parallel styles)
import transformers.distributed.tensor_parallel as hf_tp
import yaml
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

from hyper_parallel.config.layout import Layout
from hyper_parallel.config.plan_override import parse_plan_overrides
from hyper_parallel.distributed.mesh import ParallelDims
from hyper_parallel.planning.planner import PlanError, ShardingPlanner
from hyper_parallel.planning.roles import (
    EXPERT_DIM,
    FULL,
    LEGACY_TP_STYLES,
    REPLICATED,
    ROLE_BUILDERS,
    SEQUENCE,
    SPLIT,
    TP_STYLES,
    packed_experts,
    parameter_placement,
    style_meaning,
)
from tests.families.family_cases import FAMILY_CONFIGS

TP = "tp"
LAYER = "model.layers.0"


def _meta_model(family: str) -> nn.Module:
    config = transformers.AutoConfig.from_pretrained(FAMILY_CONFIGS / family)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _plan(model: nn.Module, *, hints=None, overrides=None, sequence_parallel=False, **dims):
    parallel = ParallelDims(**({"tp": 2} | dims))
    return ShardingPlanner(model, Layout(parallel, sequence_parallel=sequence_parallel), hints=hints,
                           overrides=overrides).plan()


# --- the table against transformers itself -------------------------------------------------


def test_every_transformers_style_is_mapped_or_refused():
    """A style a future transformers adds fails here until the table maps or refuses it."""
    registered = set(ALL_PARALLEL_STYLES.keys())
    assert registered == set(TP_STYLES), (sorted(registered - set(TP_STYLES)), sorted(set(TP_STYLES) - registered))
    assert not set(LEGACY_TP_STYLES) & registered
    for name, meaning in {**TP_STYLES, **LEGACY_TP_STYLES}.items():
        assert (meaning.role is None) == bool(meaning.refused), name
        assert meaning.role is None or meaning.role in ROLE_BUILDERS, name
    assert style_meaning("colwise_sideways") is None


def _transformers_io(style) -> tuple[str, str] | None:
    """(input expected, output handed on) as transformers' style object does it."""
    if isinstance(style, hf_tp.ColwiseParallel):
        assert style.input_layouts == Replicate()
        return FULL, FULL if style.output_layouts == Replicate() else SPLIT
    if isinstance(style, hf_tp.RowwiseParallel):
        assert style.output_layouts == Replicate()
        return SPLIT if isinstance(style.input_layouts, Shard) else FULL, FULL
    if isinstance(style, hf_tp.PackedColwiseParallel):
        return FULL, SPLIT  # replicated input, this rank's slice of every packed block out
    if isinstance(style, hf_tp.SequenceParallel):
        return SEQUENCE, SEQUENCE
    if isinstance(style, (hf_tp.MoeExpertsParallel, hf_tp.EmbeddingParallel)):
        return FULL, FULL  # replicated in, partial sums (or a gathered slice) reduced out
    return None


# Styles whose transformers object declares the layouts it takes and hands on (the others
# leave activations alone or act on gradients only: replicated_with_grad_allreduce, ...).
_DECLARING_LAYOUTS = sorted(name for name in ALL_PARALLEL_STYLES.keys()
                            if _transformers_io(ALL_PARALLEL_STYLES[name]) is not None)


@pytest.mark.parametrize("name", _DECLARING_LAYOUTS)
def test_style_meaning_is_what_transformers_does_to_activations(name):
    assert (TP_STYLES[name].expects, TP_STYLES[name].produces) == _transformers_io(ALL_PARALLEL_STYLES[name])


@pytest.fixture(scope="module")
def fake_tp_mesh():
    """A 2-rank mesh on torch's fake process group: transformers' shard_param builds
    DTensor metadata on meta tensors, no collective runs."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


_PARAMETERS = {"weight": (8, 4), "bias": (8,), "sinks": (4,), "experts": (2, 8, 4)}


def _same_placement(ours, theirs) -> bool:
    if isinstance(ours, _StridedShard) or isinstance(theirs, _StridedShard):
        return (isinstance(ours, _StridedShard) and isinstance(theirs, _StridedShard)
                and (ours.dim, ours.split_factor) == (theirs.dim, theirs.split_factor))
    return ours == theirs


@pytest.mark.parametrize("name", sorted(TP_STYLES))
def test_parameter_layout_is_what_transformers_shard_param_does(name, fake_tp_mesh):
    meaning = TP_STYLES[name]
    for param_name, shape in _PARAMETERS.items():
        if name == "embedding_colwise" and len(shape) == 1:
            continue  # transformers itself cannot split a vector on dim 1
        module = nn.Module()
        with torch.device("meta"):
            module.register_parameter(param_name, nn.Parameter(torch.empty(shape)))
        ALL_PARALLEL_STYLES[name].shard_param(module, param_name, fake_tp_mesh)
        theirs = getattr(module._parameters[param_name], "placements", (Replicate(),))[0]
        if meaning.param_layout is None:  # a module-level style: refused on a parameter
            assert theirs == Replicate(), (name, param_name, theirs)
            with pytest.raises(PlanError, match=name):
                parameter_placement(name, param_name, len(shape))
        elif meaning.param_layout == EXPERT_DIM:  # transformers' ep plan: dim 0 over ep, nothing on tp
            assert theirs == Shard(0) and parameter_placement(name, param_name, len(shape)) == Replicate()
        else:
            ours = parameter_placement(name, param_name, len(shape))
            assert _same_placement(ours, theirs), (name, param_name, ours, theirs)
            assert meaning.param_layout != REPLICATED or theirs == Replicate()


# --- gathered projections: OLMo-2, Phi-3 ---------------------------------------------------


def test_olmo2_gathered_qkv_feed_full_features_to_norms_and_o_proj():
    result = _plan(_meta_model("olmo2"))
    roles, modules = result.roles, result.modules
    attn = f"{LAYER}.self_attn"
    assert [roles[f"{attn}.{n}"] for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")] == \
        ["colwise_gathered"] * 3 + ["rowwise_split_input", "replicate", "replicate"]
    q_proj = modules[f"{attn}.q_proj"]
    assert q_proj.state_shardings == {"weight": {TP: Shard(0)}}
    assert (q_proj.out_src, q_proj.out_dst) == (({TP: Shard(-1)},), ({TP: Replicate()},))
    o_proj = modules[f"{attn}.o_proj"]  # splits its full input itself
    assert (o_proj.in_src, o_proj.in_dst) == (({TP: Replicate()},), ({TP: Shard(-1)},))
    assert o_proj.state_shardings == {"weight": {TP: Shard(1)}}
    assert modules[f"{attn}.q_norm"].in_src is None  # whole projection, every feature, every rank
    assert roles[f"{LAYER}.mlp.down_proj"] == "rowwise" and roles["lm_head"] == "lm_head"


def test_phi3_fused_projections_gathered_even_under_gqa():
    roles = _plan(_meta_model("phi3")).roles
    assert roles[f"{LAYER}.self_attn.qkv_proj"] == roles[f"{LAYER}.mlp.gate_up_proj"] == "colwise_gathered"
    assert roles[f"{LAYER}.self_attn.o_proj"] == roles[f"{LAYER}.mlp.down_proj"] == "rowwise_split_input"


def test_gathered_projections_are_not_output_heads_under_cp_and_sp():
    """Planned as lm_head, q_proj's input was declared split over cp after attention had
    gathered it (its weight gradient summed over cp twice) and o_proj reduced a sum the
    attention block reduces again under sp."""
    modules = _plan(_meta_model("olmo2"), cp=2, sequence_parallel=True).modules
    attn = f"{LAYER}.self_attn"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm"):
        entry = modules[f"{attn}.{name}"]
        named = [n for key in ("in_src", "in_dst", "out_src", "out_dst") for n in (getattr(entry, key) or ())]
        assert all("cp" not in n for n in named if n), (name, entry)
    assert modules[f"{attn}.o_proj"].out_dst == ({TP: Partial()},)  # the block reduce-scatters it
    assert modules["lm_head"].in_src == ({"cp": Shard(1), TP: Shard(1)},)  # the real head is still gathered


# --- hints used only where they agree ------------------------------------------------------


def test_a_hint_that_disagrees_with_the_module_is_not_used():
    model = _meta_model("qwen3")
    attn = f"{LAYER}.self_attn"
    roles = _plan(model, hints={
        "model.layers.*.input_layernorm": "replicated_with_grad_allreduce",  # a residual norm: no heads
        "model.layers.*.mlp.gate_proj": "embedding_rowwise",  # an embedding style on a linear
        "model.layers.*.self_attn.o_proj": "rowwise_split_input",  # but q/k/v hand on split heads
        "lm_head": "rowwise",  # the output embedding is the logits head whatever it says
    }).roles
    assert roles[f"{LAYER}.input_layernorm"] == "replicate"
    assert roles[f"{LAYER}.mlp.gate_proj"] == "colwise"
    assert roles[f"{attn}.o_proj"] == "rowwise" and roles[f"{attn}.q_norm"] == "head_norm"
    assert roles["lm_head"] == "lm_head"


def test_a_rowwise_takes_its_input_as_its_block_hands_it_on():
    gathered = {f"model.layers.*.self_attn.{n}": "colwise_gather_output" for n in ("q_proj", "k_proj", "v_proj")}
    roles = _plan(_meta_model("qwen3"), hints=gathered).roles  # o_proj still hinted rowwise by the model
    assert roles[f"{LAYER}.self_attn.o_proj"] == "rowwise_split_input"
    assert roles[f"{LAYER}.self_attn.q_norm"] == roles[f"{LAYER}.self_attn.k_norm"] == "replicate"


def test_q_k_v_split_unlike_each_other_are_refused():
    with pytest.raises(PlanError) as err:
        _plan(_meta_model("qwen3"), hints={"model.layers.*.self_attn.q_proj": "colwise_gather_output"})
    message = str(err.value)
    assert f"{LAYER}.self_attn.q_proj" in message and "k_proj, v_proj" in message, message


def test_transposed_experts_split_the_intermediate_dim_whatever_the_hint():
    """Llama 4's experts are [E, H, 2I] / [E, I, H] with no is_transposed flag; the shapes say which dim is I."""
    experts = nn.Module()
    with torch.device("meta"):
        experts.gate_up_proj = nn.Parameter(torch.empty(4, 64, 2 * 32))
        experts.down_proj = nn.Parameter(torch.empty(4, 32, 64))
    config = packed_experts(experts, {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"})
    assert config.state_shardings["gate_up_proj"][TP] == _StridedShard(2, split_factor=2)
    assert config.state_shardings["down_proj"][TP] == Shard(1)


def test_local_params_split_each_parameter_as_its_own_entry_says():
    attention = nn.Module()
    with torch.device("meta"):
        attention.sinks = nn.Parameter(torch.empty(4))
        attention.scale = nn.Parameter(torch.empty(4))
    config = ROLE_BUILDERS["local_params"](attention, {"sinks": "colwise"})
    assert config.state_shardings == {"sinks": {TP: Shard(0)}, "scale": {TP: Replicate()}} and config.local_map


# --- refusals ------------------------------------------------------------------------------


def _override_entries(message: str) -> tuple:
    """The entries the message suggests, as the recipe loader would hand them on."""
    return parse_plan_overrides([yaml.safe_load(line.split(", e.g. ", 1)[1])
                                 for line in message.splitlines() if ", e.g. " in line])


@pytest.mark.parametrize("layout", [{}, {"cp": 2, "sequence_parallel": True}], ids=["tp2", "tp2_cp2_sp"])
def test_unknown_style_is_refused_with_the_entry_that_places_the_module(layout):
    model = _meta_model("qwen3")
    hints = {"model.layers.*.self_attn.q_proj": "colwise_sideways"}
    with pytest.raises(PlanError) as err:
        _plan(model, hints=hints, **layout)
    message = str(err.value)
    assert f"cannot plan module {LAYER}.self_attn.q_proj (Linear)" in message, message
    assert "'colwise_sideways'" in message and "plan_overrides" in message, message
    entries = _override_entries(message)
    assert [entry.match for entry in entries] == ["model.layers.*.self_attn.q_proj"], message
    placed = _plan(model, hints=hints, overrides=entries, **layout)  # the entry makes it plannable ...
    assert placed.modules == _plan(model, **layout).modules  # ... exactly as the structure alone plans it


@pytest.mark.parametrize("target, style, words", [
    ("model.layers.*.self_attn.k_proj", "mla_kv_a_proj", "rope slice"),
    ("model.layers.*.mlp.down_proj", "all_reduce", "partial-sum output"),
    ("model.layers.*.mlp.up_proj", "packed_rowwise", "parameter-level style"),
    ("model.layers.*.mlp", "moe_identity_expert", "one term of its experts' partial sum"),
    ("model.layers.*.input_layernorm", "moe_identity_expert", "planned only on an nn.Identity"),
    ("model.layers.*.mlp.up_proj.weight", "moe_tp_experts", "gives a parameter no layout"),
])
def test_a_style_no_role_means_is_refused_by_name(target, style, words):
    model = _meta_model("qwen3")
    with pytest.raises(PlanError) as err:
        _plan(model, hints={target: style})
    message = str(err.value)
    module = target.removesuffix(".weight").replace("*", "0")
    assert f"cannot plan module {module} " in message and repr(style) in message and words in message, message
    assert _plan(model, hints={target: style}, overrides=_override_entries(message)).roles  # placed by the entry


def test_identity_expert_style_on_what_is_not_an_identity_is_refused():
    """``moe_identity_expert`` written on the experts' activation (no parameters, inside
    packed experts, but not an expert): handing on a zero from every rank but the first
    would drop the activation; refused by name."""
    model = _meta_model("mixtral")
    with pytest.raises(PlanError) as err:
        _plan(model, hints={"model.layers.*.mlp.experts.act_fn": "moe_identity_expert"})
    assert "model.layers.0.mlp.experts.act_fn" in str(err.value) and "nn.Identity" in str(err.value), err.value
