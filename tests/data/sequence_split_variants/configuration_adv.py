from transformers import PretrainedConfig


class AdvConfig(PretrainedConfig):
    model_type = "hp_adv_decoder"

    def __init__(self, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-6, initializer_range=0.02,
                 tie_word_embeddings=False, use_cache=False, variant="plain", **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.variant = variant
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
