"""The sequence split (sequence and context parallel) on models whose own code breaks it
in one way each (``tests/data/sequence_split_variants``, ``config.variant``): the dry run
on the traced copy and the planner must refuse by name what the split cannot do, and plan
what it can — at the unit level (trace, dry run, planner; no ranks)."""

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hyper_parallel.codegen.check.probe import faithful_probe_config
from hyper_parallel.config.layout import Layout
from hyper_parallel.distributed.mesh import ParallelDims
from hyper_parallel.planning.dataflow import analyze
from hyper_parallel.planning.local_widths_dry_run import local_widths_dry_run
from hyper_parallel.planning.planner import ShardingPlanner

VARIANTS = Path(__file__).resolve().parents[1] / "data" / "sequence_split_variants"
LAYOUTS = {"cp": (ParallelDims(cp=2), {}), "sp": (ParallelDims(tp=2), {"sequence_parallel": True})}
# variant -> what the planner says under both layouts: "planned", "whole" (planned, the
# stream gathered where it leaves the layers), or a substring of the refusal.
EXPECTED = {
    "plain": "planned",
    "shift_between_blocks": "is not per-token",
    "shift_between_layers_only": "is not per-token",
    "shift_before_norm": "is not per-token",
    "zero_shift": "is not per-token",  # a gate that starts at zero
    "buffer_shift": "is not per-token",  # a mixing buffer zero at init (a checkpoint sets it)
    "view_full": "whole",
    "view_full_proj": "whole",
    "sigmoid_attn": "planned",  # attention by its names: gathered by both the dry run and the layout
    "bloom_two_out": "planned",
    "handout_list": "planned",
    "handout_view": "hands out its parameter out_bias as a view",
    "handout_mlp_uses": "which model.layers.0.mlp takes as an input",
    "shared_norm": "is called again elsewhere in the forward",
    "layers_twice": "whose dim 1 is not the sequence",
    "seq_first": "whose dim 1 is not the sequence",
    "per_layer_input": "planned",  # a per-token input of every layer, cut to the piece too
    "per_layer_input_shift": "needs the whole sequence",  # ... which the layer then shifts: refused
}


def _model(variant: str, tmp_path: Path):
    folder = tmp_path / f"adv_{variant}"
    shutil.copytree(VARIANTS, folder)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True, variant=variant)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, trust_remote_code=True, dtype=torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", EXPECTED)
def test_the_split_is_planned_or_refused_by_name(variant, layout, tmp_path):
    dims, options = LAYOUTS[layout]
    tiny = _model(variant, tmp_path)
    ids = torch.randint(0, tiny.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    flow = analyze(tiny, ids, tp=dims.tp, dry_run=local_widths_dry_run(tiny, ids, dims.tp), sequence_split=layout)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tiny.config, trust_remote_code=True)
    planner = ShardingPlanner(meta, Layout(dims, **options), dataflow=flow)
    expected = EXPECTED[variant]
    if expected in ("planned", "whole"):
        assert planner.plan().roles, variant
        assert flow.whole_after_layers == (expected == "whole"), (variant, flow.sequence_split_error)
        assert flow.split_layer_inputs == ((1,) if variant == "per_layer_input" else ()), flow.split_layer_inputs
    else:
        key = "cp_size" if layout == "cp" else "sequence_parallel"
        with pytest.raises(Exception, match=rf"accelerator\.{key}: ") as refusal:
            planner.plan()
        assert expected in str(refusal.value), str(refusal.value)


def test_the_traced_copy_keeps_two_layers_where_the_sequence_is_split(tmp_path):
    # The code between two layers (a shift before every layer but the first) runs only in a
    # copy of two layers or more; one layer holds every layer kind of this model.
    config = _model("shift_between_layers_only", tmp_path).config
    assert faithful_probe_config(config, remote=True, where="test")[1] == 1
    assert faithful_probe_config(config, remote=True, where="test", min_depth=2)[1] == 2
