"""The run observed (issue 28): the streamed metrics file, the FLOPs-per-token model behind
MFU, TensorBoard scalars and the plot subcommand. The SIGKILL case is
tests/trainer/test_checkpoint_kill.py (every killed trial's metrics file is checked)."""

import json
import subprocess
import sys

import pytest
import transformers

from hyper_parallel.config import load_training_config
from hyper_parallel.platform.device import RunDevice
from hyper_parallel.trainer.base import StepRecord
from hyper_parallel.trainer.metrics import MetricsStream, read_metrics
from hyper_parallel.trainer.observe import StepObserver, flops_per_token
from hyper_parallel.trainer.plot import plot_main
from tests.project_fixtures import TINY_RECIPE

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _record(step: int, **extra) -> dict:
    return {"step": step, "loss": 5.0 - step / 10, "grad_norm": 1.0, "tokens_per_s": 100.0 + step, "seconds": 0.1,
            "lr": 1e-3, **extra}


def test_a_resumed_run_keeps_the_history_up_to_its_checkpoint(tmp_path):
    path = tmp_path / "m.jsonl"
    stream = MetricsStream(path, first_step=0)
    for step in range(1, 6):
        stream.write(_record(step))
    stream.close()
    with open(path, "a") as file:  # a line a kill cut off
        file.write('{"step": 6, "lo')
    resumed = MetricsStream(path, first_step=3)  # the checkpoint was after step 3
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]  # on disk before its first step
    resumed.write(_record(4))
    resumed.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]
    MetricsStream(path, first_step=0).close()  # a fresh run starts the file afresh
    assert path.read_text() == ""


def test_each_line_is_on_disk_when_write_returns(tmp_path):
    path = tmp_path / "m.jsonl"
    stream = MetricsStream(path, first_step=0)
    stream.write(_record(1))
    assert read_metrics(path) == [_record(1)]  # read by another file object, before close
    stream.close()


def test_flops_per_token_counts_attention_only_in_attention_layers():
    """A hybrid decoder's linear-attention layers and a state-space model compute no
    attention scores over the sequence: no attention term for them."""
    hybrid = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8))
    linear_only = flops_per_token(hybrid, seq_len=16) - 12 * 1 * 4 * 8 * 16  # one attention layer of two
    assert linear_only == flops_per_token(hybrid, seq_len=32) - 12 * 1 * 4 * 8 * 32
    mamba = transformers.AutoModelForCausalLM.from_config(transformers.MambaConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=4))
    assert flops_per_token(mamba, seq_len=16) == flops_per_token(mamba, seq_len=1024) > 0


def test_flops_per_token_is_six_n_plus_the_attention_term():
    config = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                         moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                         tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config)
    embedding = 128 * 32
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    total = sum(p.numel() for p in model.parameters())
    active = total - embedding - experts + experts * 2 / 4  # two of four experts per token
    assert flops_per_token(model, seq_len=16) == 6 * active + 12 * 2 * 4 * 8 * 16
    tied = transformers.AutoModelForCausalLM.from_config(config.__class__(**{**config.to_dict(),
                                                                             "tie_word_embeddings": True}))
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    # the head shares the embedding's parameter but is a matmul all the same: counted once, as untied
    assert flops_per_token(tied, seq_len=16) == flops_per_token(model, seq_len=16)


def test_the_observer_fills_mfu_memory_and_eta_and_writes_tensorboard(project, tmp_path):
    recipe = project / TINY_RECIPE
    recipe.write_text(recipe.read_text().replace("  seed: 0\n", "  seed: 0\n  metrics:\n    tensorboard_dir: tb\n"
                                                 "    peak_flops_per_s: 1.0e+9\n"))
    config = load_training_config(recipe)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(recipe.parent / "models" / "tiny-qwen3-moe"))
    observer = StepObserver(model=model, config=config, rank=0, world=1, device=RunDevice("cpu"), first_step=0,
                            metrics_path=str(tmp_path / "m.jsonl"))
    for step in (1, 2):
        observer.observe(StepRecord(step, 5.0, 1.0, 1000.0, 0.5, 1e-3))
    observer.close()
    records = read_metrics(tmp_path / "m.jsonl")
    flops = flops_per_token(model, config.training.seq_len)
    assert records[0]["mfu"] == pytest.approx(1000.0 * flops / 1.0e9)
    assert records[0]["eta_s"] == pytest.approx(0.5 * (config.training.steps - 1))
    assert len(records[1]["peak_memory_bytes"]) == 1 and records[1]["peak_memory_bytes"][0] > 50 * 2**20
    events = list((recipe.parent / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 100
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(recipe.parent / "tb")).Reload().Tags()["scalars"]
    assert {"train/loss", "train/mfu", "train/lr", "train/peak_memory_gib_max"} <= set(scalars)


def test_plot_writes_a_png(tmp_path):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps(_record(step, eval_loss=4.0 if step % 5 == 0 else None)) + "\n"
                               for step in range(1, 21)))
    assert plot_main([str(metrics), "--out", str(tmp_path / "loss.png")]) == 0
    data = (tmp_path / "loss.png").read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


@pytest.mark.parametrize("content, message", [(None, "metrics file not found"), ("", "no step records"),
                                              ("not json\n", "not a metrics file")])
def test_plot_refuses_what_it_cannot_draw_in_one_line(tmp_path, content, message):
    metrics = tmp_path / "m.jsonl"
    if content is not None:
        metrics.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "hyper_parallel.trainer", "plot", str(metrics), "--out",
                           str(tmp_path / "x.png")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr and str(metrics) in proc.stderr, proc.stderr
    assert not (tmp_path / "x.png").exists()



def test_flops_per_token_reads_a_heterogeneous_config_layer_by_layer():
    """A heterogeneous config (``per_layer_config``: dots3's heads differ per layer) raises
    when its heads are read for the whole model; the attention term sums each layer's own."""
    from hyper_parallel.testing.tiny_families import tiny_config

    config = tiny_config("dots3_note_text")
    assert config.is_heterogeneous
    model = transformers.AutoModelForCausalLM.from_config(config)
    widths = [view.num_attention_heads * view.head_dim for view in config.per_layer_config]
    assert flops_per_token(model, seq_len=32) - flops_per_token(model, seq_len=16) == 12 * 16 * sum(widths)
