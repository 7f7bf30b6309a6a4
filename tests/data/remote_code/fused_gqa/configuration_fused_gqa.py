"""Configuration of the fused-GQA parallel-block decoder (remote code, see
modeling_fused_gqa.py). Falcon-style field names (``n_layer``, ``num_kv_heads``,
``layer_norm_epsilon``, ``ffn_hidden_size``), mapped to transformers' standard names by
``attribute_map``; the input and output embeddings are tied by default."""

from transformers import PretrainedConfig


class FusedGQAConfig(PretrainedConfig):
    model_type = "hp_fused_gqa"
    attribute_map = {
        "num_hidden_layers": "n_layer",
        "num_key_value_heads": "num_kv_heads",
        "intermediate_size": "ffn_hidden_size",
    }

    def __init__(self, vocab_size=256, hidden_size=64, n_layer=2, num_attention_heads=4, num_kv_heads=2,
                 ffn_hidden_size=128, layer_norm_epsilon=1e-5, rope_theta=10000.0, initializer_range=0.02,
                 tie_word_embeddings=True, use_cache=False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.n_layer = n_layer
        self.num_attention_heads = num_attention_heads
        self.num_kv_heads = num_kv_heads  # grouped-query attention inside one fused projection
        self.ffn_hidden_size = ffn_hidden_size
        self.layer_norm_epsilon = layer_norm_epsilon
        self.rope_theta = rope_theta
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
