"""Configuration of the fused decoder, a made-up decoder-only family shipped as remote
code (``auto_map`` in config.json), unknown to transformers and to the planner."""

from transformers import PretrainedConfig


class FusedDecoderConfig(PretrainedConfig):
    model_type = "hp_fused_decoder"

    def __init__(self, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, rms_norm_eps=1e-6, initializer_range=0.02,
                 tie_word_embeddings=False, use_cache=False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        # the fused [q | k | v] projection has three equal parts: no grouped-query attention
        self.num_key_value_heads = num_attention_heads
        self.head_dim = hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
