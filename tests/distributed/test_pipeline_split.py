"""Pipeline stages: the split of the decoder layers, and a model's stages run one after
another in one process give the whole model's logits (no process group needed: the
stages are the pruned models, and what would cross ranks is handed on by hand)."""

import copy

import pytest
import torch
import transformers

from hyper_parallel.config.pipeline import (
    PP_SCHEDULES,
    PipelineError,
    PipelineSettings,
    balanced_split,
    stage_split,
)
from hyper_parallel.distributed.pipeline import (
    SCHEDULE_CLASSES,
    PrunedModule,
    PassThrough,
    PipelineSplitError,
    StageModule,
    check_stage_handoff,
    decoder_layer_weights,
    names_only_pruned,
    prune_to_stage,
    pruned_names,
)


def test_equal_layers_split_by_count_and_unequal_ones_by_weight():
    assert balanced_split([5] * 4, 2) == ((0, 2), (2, 4))
    assert balanced_split([5] * 6, 3) == ((0, 2), (2, 4), (4, 6))
    # a heavy (MoE) layer among light (dense) ones gets a stage to itself
    assert balanced_split([1, 1, 1, 1, 10, 1], 2) == ((0, 4), (4, 6))
    assert balanced_split([10, 1, 1, 1, 1, 10], 3) == ((0, 1), (1, 5), (5, 6))
    for stages in range(1, 7):  # every layer once, in order, no stage empty
        ranges = balanced_split([3, 1, 4, 1, 5, 9], stages)
        assert [a for a, _ in ranges][0] == 0 and ranges[-1][1] == 6
        assert all(a < b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(stages - 1))


def test_split_points_are_the_recipes_and_bad_ones_are_refused_naming_the_key():
    assert stage_split(PipelineSettings(split_points=(1,)), 2, [1] * 4) == ((0, 1), (1, 4))
    with pytest.raises(PipelineError, match=r"accelerator.pipeline.split_points: expected 1 increasing layer indices "
                                            r"in 1..3 .*got \[1, 2\]"):
        stage_split(PipelineSettings(split_points=(1, 2)), 2, [1] * 4)
    with pytest.raises(PipelineError, match="split_points: expected 1 increasing layer indices in 1..3"):
        stage_split(PipelineSettings(split_points=(4,)), 2, [1] * 4)
    with pytest.raises(PipelineError, match="split_points: expected increasing layer indices >= 1"):
        PipelineSettings(split_points=(2, 1))
    with pytest.raises(PipelineError, match="accelerator.pp_size: 3 stages need at least 3 decoder layers, the model "
                                            "has 2"):
        stage_split(PipelineSettings(), 3, [1, 1])
    with pytest.raises(PipelineError, match=r"accelerator.pipeline.schedule: expected one of 1f1b, gpipe, "
                                            r"interleaved_1f1b, interleaved_zero_bubble, zbv, dualpipev, got 'zb'"):
        PipelineSettings(schedule="zb")


def test_every_schedule_the_recipe_may_name_has_an_engine_class():
    from torch.distributed import pipelining

    assert set(SCHEDULE_CLASSES) == set(PP_SCHEDULES)
    assert all(hasattr(pipelining, name) for name in SCHEDULE_CLASSES.values())


def _tiny(family: str):
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=8)
    elif family == "qwen3_sliding":  # per-layer attention kinds, looked up by the layer's index
        config = transformers.Qwen3Config(**common, head_dim=8, use_sliding_window=True, sliding_window=4,
                                          max_window_layers=2)
    elif family == "llama":
        config = transformers.LlamaConfig(**common)
    elif family == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=4)
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=16, decoder_sparse_step=2, mlp_only_layers=[0])
    elif family == "gemma2":  # scales the embeddings inside the base model's forward
        config = transformers.Gemma2Config(**common, head_dim=8, sliding_window=4)
    elif family == "phi3":
        config = transformers.Phi3Config(**common)
    else:
        raise AssertionError(family)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)


FAMILIES = ["qwen3", "qwen3_sliding", "llama", "mistral", "qwen3_moe", "gemma2", "phi3"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stages", [2, 3])
def test_the_stages_run_in_turn_give_the_whole_models_logits_and_gradients(family, stages):
    whole = _tiny(family).train()
    boundaries = stage_split(PipelineSettings(), stages, decoder_layer_weights(whole))
    parts = []
    for index in range(stages):
        part = copy.deepcopy(whole)
        prune_to_stage(part, boundaries, (index,))
        parts.append(StageModule(part, index))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    want = whole(input_ids=ids, labels=ids)
    hidden = ids
    for part in parts:
        hidden = part(hidden)
    assert torch.allclose(hidden, want.logits, rtol=1e-5, atol=1e-6), (hidden - want.logits).abs().max()
    loss = parts[-1].model.loss_function(logits=hidden, labels=ids, vocab_size=96)
    assert torch.allclose(loss, want.loss, rtol=1e-6)
    loss.backward()
    want.loss.backward()
    held = {name: param for part in parts for name, param in part.model.named_parameters()}
    assert set(held) == {name for name, _ in whole.named_parameters()}  # each parameter on exactly one stage
    assert sum(1 for part in parts for _ in part.model.parameters()) == len(held)
    for name, param in whole.named_parameters():
        assert torch.allclose(held[name].grad, param.grad, rtol=1e-4, atol=1e-6), name


def test_a_stage_keeps_its_layers_names_and_records_what_it_took_out():
    model = _tiny("qwen3")
    info = prune_to_stage(model, ((0, 1), (1, 3), (3, 4)), (1,))
    assert (info.stages, info.num_stages, info.layers, info.is_first, info.is_last) == ((1,), 3, (1, 2), False, False)
    assert isinstance(model.model.layers[0], PassThrough) and isinstance(model.model.layers[3], PassThrough)
    assert isinstance(model.model.embed_tokens, PrunedModule) and isinstance(model.lm_head, PrunedModule)
    assert isinstance(model.model.norm, PassThrough)
    assert {name for name, _ in model.named_parameters()} == {
        name for name, _ in _tiny("qwen3").named_parameters() if name.startswith(("model.layers.1.", "model.layers.2."))}
    taken = pruned_names(model)
    assert "model.layers.0.self_attn.q_proj" in taken and "lm_head" in taken and "model.norm" in taken
    assert names_only_pruned("model.layers.3.mlp.*", taken) and names_only_pruned("model.embed_tokens", taken)
    assert not names_only_pruned("model.layers.1.mlp", taken) and not names_only_pruned("model.nothing", taken)
    with pytest.raises(Exception, match="the input embeddings runs on another pipeline stage"):
        model.model.embed_tokens(torch.zeros(1, 2, dtype=torch.long))


def test_virtual_stages_loop_over_the_ranks_and_each_stage_runs_only_its_layers():
    """Interleaved: 2 ranks x 2 virtual stages of 1 layer; rank r holds stages r and r + 2.
    The stages run in order, each through its rank's model, give the whole model's logits
    and gradients (a rank's other stage's layers and, before the last stage, the final
    norm hand the hidden states on)."""
    settings = PipelineSettings("interleaved_1f1b", virtual_stages=2)
    whole = _tiny("qwen3").train()
    boundaries = stage_split(settings, 2, decoder_layer_weights(whole))
    assert boundaries == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert settings.stages_of_rank(0, 2) == (0, 2) and settings.stages_of_rank(1, 2) == (1, 3)
    ranks = []
    for rank in range(2):
        part = copy.deepcopy(whole)
        info = prune_to_stage(part, boundaries, settings.stages_of_rank(rank, 2))
        assert info.layers == (rank, rank + 2) and info.is_first == (rank == 0) and info.is_last == (rank == 1)
        ranks.append(part)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    want = whole(input_ids=ids, labels=ids)
    hidden = ids
    for stage in range(4):
        hidden = StageModule(ranks[stage % 2], stage)(hidden)
    assert torch.allclose(hidden, want.logits, rtol=1e-5, atol=1e-6)
    ranks[1].loss_function(logits=hidden, labels=ids, vocab_size=96).backward()
    want.loss.backward()
    held = {name: p for part in ranks for name, p in part.named_parameters()}
    assert set(held) == {name for name, _ in whole.named_parameters()}
    for name, param in whole.named_parameters():
        assert torch.allclose(held[name].grad, param.grad, rtol=1e-4, atol=1e-6), name
    for rank, part in enumerate(ranks):  # each rank's own layers are back in place after the other stage ran
        assert [type(layer).__name__ for layer in part.model.layers] == [
            "Qwen3DecoderLayer" if i % 2 == rank else "PassThrough" for i in range(4)]


def _meta_copy(model):
    """The same family on the meta device, as the sharded load and derive build it."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return transformers.AutoModelForCausalLM.from_config(model.config, attn_implementation="eager",
                                                             dtype=torch.float32)


@pytest.mark.parametrize("family", FAMILIES)
def test_families_whose_stages_compose_pass_the_handoff_check_on_weights_and_on_meta(family):
    model = _tiny(family).eval()
    check_stage_handoff(model)  # in train mode, as the stages run
    check_stage_handoff(_meta_copy(model))
    assert all("forward" not in m.__dict__ for m in model.modules())  # the recorders are gone again
    assert not any(m.training for m in model.modules())  # and each module's mode is as it was


TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
REFUSED = {
    # position embeddings added to the input embeddings inside the base model's forward
    "gpt2": (lambda: transformers.GPT2Config(n_embd=32, n_layer=4, n_head=4, vocab_size=96, n_positions=64,
                                             bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
             r"GPT2Model cannot be split into pipeline stages: its forward changes the hidden states between the "
             r"input embeddings and decoder layer 0 \(it runs wpe, drop there\)"),
    # the input embeddings scaled there (Granite's embedding_multiplier)
    "granite": (lambda: transformers.GraniteConfig(**TINY, intermediate_size=48, num_key_value_heads=2,
                                                   embedding_multiplier=12.0),
                "GraniteModel cannot be split .* between the input embeddings and decoder layer 0"),
    # embedding dropout: a later stage would drop out its input again
    "phi_dropout": (lambda: transformers.PhiConfig(**TINY, intermediate_size=48, embd_pdrop=0.1),
                    r"PhiModel .* between the input embeddings and decoder layer 0 \(it runs embed_dropout there\)"),
    # layers that return a tuple, of which the base model's loop takes item 0
    "falcon": (lambda: transformers.FalconConfig(**TINY),
               "FalconModel cannot be split into pipeline stages: its forward "),
}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_a_family_whose_forward_changes_the_hidden_states_is_refused_naming_where(family):
    config, message = REFUSED[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation="eager", dtype=torch.float32)
    for copy_ in (model, _meta_copy(model)):
        with pytest.raises(PipelineSplitError, match=message + ".*set accelerator.pp_size: 1"):
            check_stage_handoff(copy_)


def test_the_handoff_check_refuses_what_would_train_silently_wrong():
    """The fault it is named after: GPT-2's two stages run in turn give other logits than
    the whole model (the second stage adds the position embeddings again)."""
    whole = transformers.AutoModelForCausalLM.from_config(REFUSED["gpt2"][0](), dtype=torch.float32).eval()
    parts = []
    for index in range(2):
        part = copy.deepcopy(whole)
        prune_to_stage(part, ((0, 2), (2, 4)), (index,))
        parts.append(StageModule(part, index))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    assert not torch.allclose(parts[1](parts[0](ids)), whole(input_ids=ids).logits, atol=1e-3)
    with pytest.raises(PipelineSplitError):
        check_stage_handoff(whole)


def test_a_pass_through_keeps_the_plain_settings_the_base_model_reads_of_its_layers():
    model = _tiny("qwen3_sliding")
    layer = model.model.layers[3]
    layer.attention_type = "sliding_attention"  # as families that pick each layer's mask by it have
    prune_to_stage(model, ((0, 2), (2, 4)), (0,))
    stand_in = model.model.layers[3]
    assert isinstance(stand_in, PassThrough) and stand_in.attention_type == "sliding_attention"
    assert not list(stand_in.parameters()) and not hasattr(stand_in, "mlp")  # settings, not submodules
