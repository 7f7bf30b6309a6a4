"""What each plan role and placement means, in one line: the legend the generated file
prints above its plan. Torch-free, because the emit stage runs without torch.

The roles are the planner's vocabulary (``roles.py`` for the tensor-parallel roles,
``sequence_layout.py`` for the blocks a sequence split rewrites); a reviewer reading a
plan in a pull request should not need that source to know what ``sequence_split``
does. ``tests/distributed/test_role_legend.py`` checks that every role the planner can
write has a line here.
"""

ROLE_LEGEND: dict[str, str] = {
    "colwise": "weight split by output rows; output stays split on the last dim",
    "colwise_gathered": "colwise, then its output is gathered (the next op needs every feature)",
    "rowwise": "weight split by input columns; input arrives split, output a partial sum",
    "rowwise_split_input": "rowwise whose input arrives whole and is split first",
    "vocab_embedding": "embedding rows (the vocabulary) split; the partial lookups are summed",
    "lm_head": "output head: vocabulary rows split; logits gathered or fed to the sharded loss",
    "packed_experts": "stacked experts: gate_up and down split over tp, the expert dim over ep",
    "head_norm": "per-head norm on head-split activations; weight gradients summed over tp",
    "fused_qkv": "one projection packing q, k and v: each part split over tp",
    "fused_gate_up": "one projection packing gate and up: each part split over tp",
    "projection_norm": "norm over a whole projection's output: gathered in, split out again",
    "local_params": "own parameters placed as the model's TP plan says; activations unchanged",
    "local_params_summed": "own parameters placed as the TP plan says; the output is a partial sum",
    "replicate": "whole weights on every rank; gradients summed over the axes splitting the input",
    "head_split": "a recurrent layer (gated delta-net) run on this rank's heads: local_sizes divided by tp, "
                  "local_slices: this rank's piece of each packed block (stored so when placed shard: packed order; "
                  "placed replicate under FSDP2: taken as it runs, gradients summed over tp)",
    "colwise_by_parent": "output rows of unequal packed blocks split; the head_split parent hands it its rows",
    "identity_share": "an identity expert: its output becomes a share of a partial sum",
    "sequence_split": "the residual stream is split over the sequence from here on",
    "attention_block": "attention: its input gathered over the sequence split, output split again",
    "kv_gathered_attention": "attention on the rank's tokens (cp): K and V gathered over cp inside it",
    "ulysses_attention": "attention on the rank's tokens (cp): all-to-all to a head group's whole sequence",
    "gathered_block": "a block that needs the whole sequence: input gathered, output split again",
    "state_handoff": "a recurrent block on the rank's tokens (cp): its state handed on from the previous cp rank "
                     "(state_handoff: cp), one rank after another",
    "mlp_block": "per-token MLP: input gathered over tp only; output partial sums reduce-scattered",
    "moe_block": "per-token MoE block: like mlp_block, tokens stay split over cp",
    "custom": "written by the recipe's plan_overrides",
}

PLACEMENT_LEGEND = ("AXIS=replicate|shard(dim)|partial (summands)|packed_shard(dim,parts) (each part split), "
                    "else replicate")
KEYS_LEGEND = ("PARAM: placements; in/out: as arriving [-> as needed], (a, b) per position, - none; "
               "local_map: local tensors")


def legend_lines(roles: list[str]) -> list[str]:
    """The legend for the roles a plan uses (in the order given), then the placements and
    the entry keys; a role without a line (a new one) is listed by name, never dropped."""
    width = max((len(role) for role in roles), default=0)
    return (["roles:"] + [f"  {role.ljust(width)}  {ROLE_LEGEND.get(role, '(no legend entry)')}" for role in roles]
            + [f"placements: {PLACEMENT_LEGEND}", f"fields: {KEYS_LEGEND}"])
