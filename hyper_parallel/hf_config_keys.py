"""HF config keys that name the same size in different families (the first present counts).

A leaf module (no imports), so the config checks of the codegen stages use it without
importing torch. The plan lint, derive's size relations and the verify probe share it.
"""

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k")
# Group-limited routing (DeepSeek-V3 style): experts in groups, the top groups chosen first.
EXPERT_GROUP_KEYS = ("n_group", "num_expert_group")
TOP_GROUP_KEYS = ("topk_group",)


def layer_views(config) -> list:
    """The config as each decoder layer reads it. transformers' heterogeneous configs
    (``per_layer_config``) hold sizes such as the heads or kv heads per layer and raise
    when one of them is read for the whole model; every check of such a size goes over
    these views. Any other config is its own single view."""
    if getattr(config, "is_heterogeneous", False):
        return list(config.per_layer_config)
    return [config]


def layer_overrides(config) -> dict[int, dict] | None:
    """A heterogeneous config's per-layer values (layer index -> the keys that layer sets),
    as ``to_dict`` writes them; None for any other config."""
    if not getattr(config, "is_heterogeneous", False):
        return None
    raw = config.to_dict().get("per_layer_config") or {}
    return {int(index): dict(values) for index, values in raw.items()}


def expert_count(config) -> tuple[str, int] | None:
    """(key, value) of the model's expert count: the first of ``EXPERT_COUNT_KEYS`` on the
    config, else on a config nested in it (DBRX keeps ``moe_num_experts`` in its
    ``ffn_config``; the key is then written ``ffn_config.moe_num_experts``)."""
    for key in EXPERT_COUNT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return key, value
    for name, nested in vars(config).items():
        if type(nested).__name__.endswith("Config") and nested is not config:
            found = expert_count(nested)
            if found is not None:
                return f"{name}.{found[0]}", found[1]
    return None
