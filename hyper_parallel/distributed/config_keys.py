"""HF config keys that name the same size in different families (the first present counts).

A leaf module (no imports), so the config checks of the codegen stages use it without
importing torch. The plan lint, derive's size relations and the verify probe share it.
"""

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k")
