"""A composite (vision-language) config whose causal-LM class is its text decoder alone:
the plan, verify and training see its ``text_config`` (``derive.text_decoder_config``)."""

import transformers

from hyper_parallel.codegen.plan.derive import text_decoder_config
from hyper_parallel.testing.tiny_families import composite_config, is_composite, tiny_config


def test_the_text_decoder_of_a_composite_config_is_what_is_planned():
    config = composite_config("qwen3_5")
    text = text_decoder_config(config)
    assert type(text) is transformers.Qwen3_5TextConfig
    assert text.to_dict() == config.get_text_config().to_dict() and text is not config.get_text_config()
    assert transformers.AutoModelForCausalLM.from_config(text).config.model_type == "qwen3_5_text"


def test_other_configs_are_left_as_they_are():
    llama = tiny_config("llama")
    assert text_decoder_config(llama) is llama
    # a composite whose causal-LM mapping has no text-only decoder keeps its own config
    llava = transformers.LlavaConfig()
    assert text_decoder_config(llava) is llava
    assert is_composite("qwen3_5_moe") and not is_composite("llava") and not is_composite("qwen3_5_text")
