"""``Layout`` (config/layout.py): the recipe's accelerator section as one value, made once;
the codegen spec carries it, and two layouts name the fields they differ in."""

import dataclasses

from hyper_parallel.codegen.spec.project import project_codegen_spec
from hyper_parallel.config import load_training_config
from hyper_parallel.config.context_parallel import ContextParallel
from hyper_parallel.config.layout import Layout
from hyper_parallel.config.parallel_dims import ParallelDims
from tests.project_fixtures import REPO, TINY_RECIPE


def test_the_spec_carries_the_recipe_s_layout_and_signs_as_before():
    config = load_training_config(REPO / TINY_RECIPE)
    spec = project_codegen_spec(config)
    assert spec.layout == config.accelerator.layout == Layout(dims=ParallelDims(tp=2))
    assert spec.parallel_record() == {"dp": 1, "cp": 1, "tp": 2, "ep": 1, "pp": 1, "sequence_parallel": False,
                                      "loss_parallel": False, "device_type": "cpu", "world_size": 2}


def test_the_context_parallel_setting_is_the_effective_one():
    accelerator = load_training_config(REPO / TINY_RECIPE).accelerator
    chosen = dataclasses.replace(accelerator.context_parallel, algorithm="allgather_kv", load_balance=True)
    at_cp1 = dataclasses.replace(accelerator, context_parallel=chosen)
    at_cp2 = dataclasses.replace(accelerator, context_parallel=chosen, cp_size=2, tp_size=1)
    assert at_cp1.layout.context_parallel == ContextParallel()  # nothing to split at cp 1
    assert at_cp2.layout.context_parallel == ContextParallel("allgather_kv", True)


def test_differences_name_every_axis_and_option():
    base = Layout(dims=ParallelDims(dp=4, ep=2))
    assert base.differences(base) == []
    assert base.differences(Layout(dims=ParallelDims(dp=4, ep=4))) == ["ep"]
    assert base.differences(Layout(dims=ParallelDims(dp=2, tp=2, ep=2))) == ["dp", "tp"]
    other = Layout(dims=ParallelDims(dp=4, ep=2), sequence_parallel=True, loss_parallel=True)
    assert base.differences(other) == ["sequence_parallel", "loss_parallel"]
