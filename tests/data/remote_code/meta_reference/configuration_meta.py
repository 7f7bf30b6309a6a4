"""Configuration of the Meta-reference decoder (remote code, see modeling_meta.py): the
field names of Meta's reference ``ModelArgs`` (``dim``, ``n_layers``, ``n_heads``,
``n_kv_heads``, ``norm_eps``), mapped to transformers' standard names by ``attribute_map``
as remote-code configs on the Hub do."""

from transformers import PretrainedConfig


class MetaReferenceConfig(PretrainedConfig):
    model_type = "hp_meta_reference"
    attribute_map = {
        "hidden_size": "dim",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "num_key_value_heads": "n_kv_heads",
        "intermediate_size": "ffn_dim",
        "rms_norm_eps": "norm_eps",
        "max_position_embeddings": "max_seq_len",
    }

    def __init__(self, vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, norm_eps=1e-5,
                 rope_theta=10000.0, max_seq_len=128, initializer_range=0.02, tie_word_embeddings=False,
                 use_cache=False, **kwargs):
        self.vocab_size = vocab_size
        self.dim = dim
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads  # grouped-query attention: n_heads // n_kv_heads queries per key/value
        self.ffn_dim = ffn_dim
        self.norm_eps = norm_eps
        self.rope_theta = rope_theta
        self.max_seq_len = max_seq_len
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
