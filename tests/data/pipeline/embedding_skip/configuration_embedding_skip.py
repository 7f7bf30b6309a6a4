"""Configuration of the embedding-skip decoder (remote code, ``auto_map``): a made-up
family whose every layer mixes the normed input embeddings back in."""

from transformers import PretrainedConfig


class EmbeddingSkipConfig(PretrainedConfig):
    model_type = "hp_embedding_skip"

    def __init__(self, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, rms_norm_eps=1e-6, initializer_range=0.02,
                 tie_word_embeddings=False, use_cache=False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads
        self.head_dim = hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
