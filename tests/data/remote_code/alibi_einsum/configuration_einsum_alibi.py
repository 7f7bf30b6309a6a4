"""Config of the einsum/ALiBi parallel-residual decoder (GPT-2 style field names)."""

from transformers import PretrainedConfig


class EinsumAlibiConfig(PretrainedConfig):
    model_type = "alibi_einsum_fixture"
    attribute_map = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
                     "intermediate_size": "n_inner"}

    def __init__(self, vocab_size=256, n_embd=64, n_head=4, n_layer=2, n_inner=128, layer_norm_epsilon=1e-5,
                 initializer_range=0.02, alibi_from_tensor=False, tie_word_embeddings=False, use_cache=False,
                 **kwargs):
        self.vocab_size = vocab_size
        self.n_embd = n_embd
        self.n_head = n_head
        self.n_layer = n_layer
        self.n_inner = n_inner
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        # False: ALiBi slopes for config.n_head heads (Bloom/MPT style); True: for the heads the
        # tensor has (shape-agnostic code, h = q.shape[2]).
        self.alibi_from_tensor = alibi_from_tensor
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
