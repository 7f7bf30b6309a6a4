"""Configuration of the linear-attention hybrid decoder (remote code, see
modeling_linear_hybrid.py): its own field names, as remote-code configs on the Hub have."""

from transformers import PretrainedConfig


class LinearHybridConfig(PretrainedConfig):
    model_type = "hp_linear_hybrid"
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "depth", "num_attention_heads": "softmax_heads"}

    def __init__(self, vocab_size=256, d_model=64, depth=4, softmax_heads=4, retention_heads=4, retention_head_dim=8,
                 conv_width=4, ffn_dim=128, softmax_every=2, norm_eps=1e-5, initializer_range=0.02,
                 tie_word_embeddings=False, use_cache=False, **kwargs):
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.depth = depth
        self.softmax_heads = softmax_heads  # the full-attention layers' heads
        self.retention_heads = retention_heads  # the recurrent layers' heads
        self.retention_head_dim = retention_head_dim
        self.conv_width = conv_width
        self.ffn_dim = ffn_dim
        self.softmax_every = softmax_every  # every softmax_every-th layer is full attention, the others recurrent
        self.norm_eps = norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
