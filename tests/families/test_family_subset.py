"""The family sweep's fast subset: 8 structurally different transformers families at tp2
and cp2, through the code the sweep runs (``bench/families``: tiny config,
``save_pretrained`` checkpoint, recipe, ``python -m hyper_parallel.codegen generate``).

Generate runs the verify stage, which trains the bundle at the recipe's world size against
single-process HF on a shrunk probe (2 AdamW steps, loss rtol 1e-5, every parameter's
gradient rtol 1e-4), so a row that generates is a row whose plan is equal to one process.
The sweep's separate 3-step training of the checkpoint under torchrun (``run_case(...,
train=True)``) is left out here: it costs about as much again per row, and the trainer's
sharded load and steps are tested in tests/trainer/test_train_equivalence.py and, for a
tied head, tests/families/test_fix_tied_embeddings.py. ``python bench/family_sweep.py
--families ... --layouts tp2,cp2`` runs the same rows with it.

Each row runs the whole generate, preflight included (issue 51). Verify runs each row's 2 ranks as threads of one process (its mode above the process cap;
tests/verify/test_verify_modes.py shows both modes agree), which costs a third less CPU
per row than 3 torchrun processes; with the same cap preflight runs in this one process too
(the integrity and plan-coverage checks training runs, and every rank's shard computed from
the plan), while tests/families/test_head_split_preflight.py runs a head-split row's
preflight on torchrun ranks through ``doit generate``. Families whose models draw random numbers in training
(``TORCHRUN_FAMILIES``) keep torchrun: verify refuses them as threads, which share one
random state.

``ROWS`` adds single rows for faults the full sweep found in other families. Each row must
have the status it has today: ``pass``, or ``refused`` with the known, intended reason
listed in ``REFUSED``.
"""

import re

import pytest

from hyper_parallel.codegen.check.verify_mode import MAX_PROCS_ENV
from hyper_parallel.testing.family_case import Case, make_project, run_case
from hyper_parallel.testing.tiny_families import family_dir, save_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# family -> what it adds to the planner's cases
FAMILIES = {
    "llama": "plain: separate q/k/v/o, gated MLP, RMSNorm, untied head",
    "qwen3": "per-head q/k norms (q_norm, k_norm over head_dim)",
    "olmo2": "q/k norms over the whole projection (hidden wide), norms after attention and MLP",
    "phi3": "fused qkv_proj and fused gate_up_proj",
    "mixtral": "packed experts (one gate_up_proj / down_proj tensor per layer), router",
    "qwen2_moe": "packed experts plus a shared expert and its sigmoid gate",
    "gemma2": "tied embeddings, sliding and full attention layers, soft-capping, extra norms",
    "starcoder2": "biases on every projection, non-gated c_fc/c_proj MLP, LayerNorm, tied head",
}
# Single rows for faults the sweep found, each in one layout: (family, layout) -> what it adds.
ROWS = {
    ("opt", "cp2"): "fc1/fc2 children of the layer itself on flattened tokens; project_out after the final norm",
    ("ctrl", "tp2_sp_lp"): "attention(x, x, x): the stream passed three times; the embedding output scaled in place",
    ("gemma3n_text", "tp2"): "AltUp's coefficients used by the layer's own code (training mode only); per-layer "
                             "embeddings; a scaled tied embedding",
    ("llama4_text", "tp2_sp_lp"): "an MoE returning its tokens flattened: refused under sp",
    ("gpt2", "tp2_sp_lp"): "a reshape to the whole sequence after the final norm (the stream is gathered there); "
                           "blocks of replicated Conv1D projections hand on a slice, not a partial sum",
    ("bloom", "cp2"): "attention and MLP that take the residual and add it to their output themselves",
    ("gpt_neox_japanese", "cp2"): "an attention returning its own bias parameter, which the layer adds on its piece",
    ("phimoe", "tp2"): "a router sampling its experts in training: every tp rank draws what one process draws "
                       "(each step seeded alike in verify, training and the reference)",
    ("phimoe", "tp2_sp_lp"): "the same under sequence parallel: each rank's tokens draw other numbers (refused)",
    ("nemotron_h", "tp2_sp_lp"): "experts no split role fits (non-gated), computed whole on every rank inside an MoE "
                                 "block whose shared experts hand on a partial sum: the block's output is not one",
    ("qwen4_exp_text", "cp2"): "a tp-split projection after the layers (the hyper-connection mixer) on each cp "
                               "rank's piece of the sequence: its weight gradients are partial sums over cp",
    ("qwen3_next", "tp2"): "a gated delta-net run on its heads: projections packed per key-head group (colwise), "
                           "[q | k | v] convolution channels of unequal widths, head counts local while it runs",
    ("qwen3_5", "tp2"): "a composite vision-language checkpoint whose causal LM is its text decoder (planned from "
                        "text_config, the towers' weights left out); its gated delta-net's in_proj_qkv packs "
                        "[q | k | v] of unequal widths: its parent hands it this rank's rows",
    ("qwen3_next", "dp2"): "a hybrid decoder (gated delta-net, full attention, MoE) under FSDP2",
    ("qwen3_next", "cp2"): "a gated delta-net on each cp rank's piece of the sequence, its recurrent state and "
                           "convolution inputs handed on from the previous cp rank through its cache protocol",
    ("mamba2", "tp2"): "a pure state-space model: Mamba2 mixers on their heads and groups ([z | x | B | C | dt] "
                       "blocks named by the mixer's sizes, the gated norm's weight per channel)",
    ("remote:linear_hybrid", "tp2"): "remote code: a recurrent mixer of its own names run per head (packed [q|k|v], "
                                     "a convolution through its weight, a per-head decay) beside attention layers",
    ("mamba2", "dp2"): "a pure state-space model under FSDP2",
    ("nemotron_h", "tp2"): "Mamba2 mixers (named mixer) beside attention and MoE layers: the mixer's entry places its "
                           "convolution's weight and bias by their dotted names, which preflight reads as the applier",
    ("mamba2", "cp2"): "Mamba2 mixers on each cp rank's piece, the scan's state handed on from rank to rank",
    ("longcat_flash", "tp2"): "zero-compute identity experts inside the packed experts (HF's moe_identity_expert); "
                              "a router applying its classifier's weight itself; two attentions and MLPs per layer",
}
# (family, layout) -> reason substring of a refusal; every other row must pass.
REFUSED: dict[tuple[str, str], str] = {("llama4_text", "tp2_sp_lp"): "returns its tokens flattened",
                                       ("phimoe", "tp2_sp_lp"): "accelerator.sequence_parallel split the tokens"}
# (family, layout) -> a plan line its bundle must hold: packed parameters of unequal blocks
# stored sharded over tp (packed order), not replicated
BUNDLE_LINES = {("qwen3_next", "tp2"): "conv1d.weight: tp=shard(0)",
                ("mamba2", "tp2"): "in_proj.weight: tp=shard(0)",
                ("qwen3_5", "tp2"): "in_proj_qkv.weight: tp=shard(0)",
                ("nemotron_h", "tp2"): "conv1d.bias: tp=shard(0) | conv1d.weight: tp=shard(0)"}
LAYOUTS = ("tp2", "cp2")
TORCHRUN_FAMILIES = {"phimoe"}  # its router samples experts in training
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def subset_project(tmp_path_factory):
    """A throwaway project with every family's checkpoint (``recipes/<family>/model``)."""
    project = make_project(tmp_path_factory.mktemp("family_subset") / "project")
    for family in {*FAMILIES, *(family for family, _ in ROWS)}:
        save_checkpoint(family, project / "recipes" / family_dir(family) / "model")
    return project


@pytest.mark.parametrize("family, layout", [(family, layout) for family in FAMILIES for layout in LAYOUTS]
                         + list(ROWS))
def test_family_row(subset_project, family, layout, monkeypatch):
    if family not in TORCHRUN_FAMILIES:
        monkeypatch.setenv(MAX_PROCS_ENV, "1")
    case = run_case(subset_project, Case(family, layout), timeout=TIMEOUT_S, train=False)
    log = subset_project / "recipes" / family_dir(family) / layout / "generate.log"
    detail = f"{family} {layout}: {case.status}: {case.reason} (log {log})"
    if (family, layout) in REFUSED:
        assert case.status == "refused", detail
        assert REFUSED[(family, layout)] in case.reason, detail
    else:
        assert case.status == "pass", detail
    if (family, layout) in BUNDLE_LINES:
        folder = subset_project / "recipes" / family_dir(family) / layout / "generated"
        text = "".join(path.read_text() for path in folder.glob("modeling_*.py"))
        text = re.sub(r'"\s*\n\s*"', "", text)  # the plan's lines are string pieces on several lines
        assert BUNDLE_LINES[(family, layout)] in text, detail
