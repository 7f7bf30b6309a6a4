"""Configuration of the list-of-experts MoE decoder (remote code, see modeling_list_moe.py):
every ``moe_every``-th layer (the 2nd, 4th, ...) is a mixture of ``num_experts`` MLPs of
width ``moe_intermediate_size`` (top ``num_experts_per_tok``) plus a shared expert; the
other layers have a dense MLP of width ``intermediate_size``."""

from transformers import PretrainedConfig


class ListMoEConfig(PretrainedConfig):
    model_type = "hp_list_moe"

    def __init__(self, vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                 intermediate_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=64, moe_every=2, max_position_embeddings=128,
                 layer_norm_eps=1e-5, initializer_range=0.02, tie_word_embeddings=False, use_cache=False,
                 **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads  # multi-head attention: as many kv heads
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.moe_every = moe_every
        self.max_position_embeddings = max_position_embeddings
        self.layer_norm_eps = layer_norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
