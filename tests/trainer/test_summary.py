"""The run's start-up and closing summaries (issue 56): what it trains, on what, in which
precision, from which data and where its outputs go; then how far it got and where to look."""

import transformers

from hyper_parallel.config import load_training_config
from hyper_parallel.trainer.base import StepRecord
from hyper_parallel.trainer.summary import closing_lines, startup_lines
from tests.project_fixtures import REPO, TINY_RECIPE


def _config(**training):
    config = load_training_config(REPO / TINY_RECIPE)
    for key, value in training.items():
        setattr(config.training, key, value)
    return config


def test_startup_names_model_layout_precision_data_and_outputs():
    config = _config()
    config.training.checkpoint.dir = "ckpt"
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"))
    lines = startup_lines(config, model, "cpu", None, "m.jsonl", first_step=0)
    total = sum(p.numel() for p in model.parameters())
    assert lines[0].startswith("model: Qwen3MoeForCausalLM from transformers") and f"{total / 1e3:.2f}K" in lines[0]
    assert lines[1] == "layout: tp 2 over 2 rank(s) on cpu"
    assert lines[2] == "precision: float32 master weights, float32 compute, float32 reduction; adamw lr 0.001"
    assert lines[3] == "data: synthetic tokens; 10 step(s) of 2 x 16 = 32 tokens"
    assert lines[4] == f"outputs: checkpoints {REPO / 'recipes/tiny_cpu/ckpt'}, metrics m.jsonl"


def test_closing_says_how_far_and_where_the_results_are():
    config = _config()
    config.training.checkpoint.dir = "ckpt"
    records = [StepRecord(1, 5.5, 1.0, 10.0, 0.1, 1e-3), StepRecord(2, 5.0, 1.0, 10.0, 0.1, 1e-3, eval_loss=5.2)]
    lines = closing_lines(records, config, started=0.0, metrics_path="m.jsonl")
    assert lines[0].startswith("done: 2 step(s), 64 tokens in ") and lines[0].endswith(
        "loss 5.5000 -> 5.0000; best eval loss 5.2000")
    assert lines[1] == (f"results: checkpoint {REPO / 'recipes/tiny_cpu/ckpt/step_2'}; metrics m.jsonl "
                        "(plot: python -m hyper_parallel.trainer plot m.jsonl --out loss.png)")
    assert closing_lines([], config, 0.0, None) == ["trained no step"]


def test_a_streamed_dataset_has_no_length_to_count_epochs_by():
    config = _config()
    config.dataset.kind, config.dataset.path = "jsonl", "data/train.jsonl"
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"))
    streamed = type("Streamed", (), {"num_rows": None})()
    line = startup_lines(config, model, "cpu", streamed, None, first_step=0)[3]
    assert line == "data: data/train.jsonl, streamed; 10 step(s) of 2 x 16 = 32 tokens", line


def test_a_model_wrapped_by_fsdp2_is_named_by_its_own_class():
    """FSDP2 (dp > 1) swaps the model's class for ``FSDP<Name>`` defined in torch: the line
    names the model's class and where its code lives, not torch's FSDP module."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(REPO / "recipes/tiny_cpu/models/tiny-qwen3-moe"))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        line = startup_lines(_config(), model, "cpu", None, None, first_step=0)[0]
    finally:
        dist.destroy_process_group()
    assert type(model).__name__ == "FSDPQwen3MoeForCausalLM"
    assert line.startswith("model: Qwen3MoeForCausalLM from transformers (transformers.models.qwen3_moe"), line
