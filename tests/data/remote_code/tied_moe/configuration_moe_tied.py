"""Config of the tied-embedding list-of-experts MoE decoder."""

from transformers import PretrainedConfig


class MoETiedConfig(PretrainedConfig):
    model_type = "tied_moe_fixture"

    def __init__(self, vocab_size=256, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                 intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                 num_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-6, initializer_range=0.02,
                 tie_word_embeddings=True, use_cache=False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_hidden_layers = num_hidden_layers
        self.intermediate_size = intermediate_size
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
