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


def test_a_recipe_without_an_algorithm_gets_allgather_kv_load_balanced_by_default():
    """cp_size 2 and no ``accelerator.context_parallel``: the attention work is split
    (allgather_kv, load-balanced), marked as the default (blocks that cannot run it gather,
    config/context_parallel.py); a recipe naming the algorithm gets it as named."""
    accelerator = load_training_config(REPO / TINY_RECIPE).accelerator
    at_cp2 = dataclasses.replace(accelerator, cp_size=2, tp_size=1)
    assert at_cp2.context_parallel.algorithm is None
    assert at_cp2.layout.context_parallel == ContextParallel("allgather_kv", True, by_default=True)
    assert at_cp2.layout.as_dict()["cp_algorithm"] == "allgather_kv"
    assert at_cp2.layout.as_dict()["cp_by_default"] is True
    assert Layout.from_dict(at_cp2.layout.as_dict(), where="meta") == at_cp2.layout
    named = dataclasses.replace(at_cp2, context_parallel=dataclasses.replace(
        at_cp2.context_parallel, algorithm="allgather_kv"))
    assert named.layout.context_parallel == ContextParallel("allgather_kv", True)
    assert "cp_by_default" not in named.layout.as_dict()
    assert named.layout.differences(at_cp2.layout) == ["context_parallel"]
    # a layout written without the cp keys (every bundle before them) gathers the sequence
    written = {key: value for key, value in at_cp2.layout.as_dict().items() if not key.startswith("cp_")}
    assert Layout.from_dict(written, where="meta").context_parallel == ContextParallel("gather_sequence", False)
    assert at_cp2.layout.describe().endswith("cp_algorithm=allgather_kv cp_load_balance=True cp_by_default=True")


def test_differences_name_every_axis_and_option():
    base = Layout(dims=ParallelDims(dp=4, ep=2))
    assert base.differences(base) == []
    assert base.differences(Layout(dims=ParallelDims(dp=4, ep=4))) == ["ep"]
    assert base.differences(Layout(dims=ParallelDims(dp=2, tp=2, ep=2))) == ["dp", "tp"]
    other = Layout(dims=ParallelDims(dp=4, ep=2), sequence_parallel=True, loss_parallel=True)
    assert base.differences(other) == ["sequence_parallel", "loss_parallel"]
