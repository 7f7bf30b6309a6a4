"""What a run reports of each step besides loss and gradient norm: model FLOPs
utilisation, peak memory per rank, the time left; and where it goes (the ``--metrics``
JSON lines, TensorBoard, rank 0's progress line).

Model FLOPs per token follow torchtitan's count (PaLM's appendix B): ``6 * N`` for the
matmuls of forward and backward over the N parameters a token passes through, plus
``12 * L * H * Dh * S`` for attention's two matmuls (scores and the weighted sum) over a
sequence of S tokens, L layers, H query heads of size Dh. N leaves out the input embedding
(a lookup, no matmul; an output head tied to it counts) and counts routed experts at top_k / num_experts of their size (a
token passes through top_k of them). MFU = (tokens/s of the run / ranks) * FLOPs per token
/ ``training.metrics.peak_flops_per_s``."""

import logging
import math
import statistics

import torch
import torch.distributed as dist

from hyper_parallel.hf_config_keys import layer_views
from hyper_parallel.platform.device import RunDevice
from hyper_parallel.platform.host_values import to_host_list
from hyper_parallel.trainer.metrics import MetricsStream

_LOG = logging.getLogger("hyper_parallel.trainer.base")


def _routed_fraction(hf_config) -> float:
    """top_k / num_experts of a mixture-of-experts config; 1 for a dense one."""
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    experts = next((getattr(hf_config, key) for key in ("num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(getattr(hf_config, key, None), int)), None)
    return top_k / experts if isinstance(top_k, int) and experts else 1.0


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Model FLOPs of one token's forward and backward (the module docstring's formula).
    Parameter sizes are global: a DTensor's ``numel`` is its whole tensor's."""
    config = model.config
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    # The lookup is left out, but a head tied to it is a matmul all the same.
    head_params = {id(p) for p in head.parameters()} if head is not None else set()
    skip = {id(p) for p in embedding.parameters() if id(p) not in head_params} if embedding is not None else set()
    fraction = _routed_fraction(config)
    active = 0.0
    for name, param in model.named_parameters():
        if id(param) in skip:
            continue
        active += param.numel() * (fraction if ".experts." in f".{name}." else 1.0)
    return 6 * active + 12 * seq_len * _attention_widths(config)


def _attention_widths(config) -> float:
    """heads * head_dim summed over the layers computing attention scores. A heterogeneous
    config (``per_layer_config``) raises when its per-layer sizes are read for the whole
    model: each layer's own view is read then."""
    views = layer_views(config)
    if len(views) == 1:
        return _attention_layers(config) * _width(config)
    types = getattr(config, "layer_types", None)
    return sum(_width(view) for index, view in enumerate(views)
               if not isinstance(types, (list, tuple)) or index >= len(types) or _scores(types[index]))


def _width(config) -> int:
    """heads * head_dim of one layer's attention; 0 without heads (a state-space model)."""
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return 0
    return heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)


def _attention_layers(config) -> int:
    """The layers that compute attention scores over the sequence: every layer, or, where
    ``layer_types`` says, those that are not linear attention, convolution or state space
    (hybrid decoders); a layer's sliding window is counted as full (an upper bound)."""
    types = getattr(config, "layer_types", None)
    if not isinstance(types, (list, tuple)) or not types:
        return config.num_hidden_layers
    return sum(1 for kind in types if _scores(kind))


def _scores(kind) -> bool:
    """Whether a ``layer_types`` entry computes attention scores over the sequence."""
    return "attention" in str(kind) and "linear" not in str(kind)


class StepObserver:
    """Fills a step's MFU, per-rank peak memory and ETA, then writes it: the metrics
    stream, TensorBoard, and the progress line every ``log_every`` steps (rank 0)."""

    def __init__(self, *, model, config, rank: int, world: int, device: RunDevice, first_step: int,
                 metrics_path: str | None):
        training = config.training
        self.steps, self.log_every, self.rank, self.world = training.steps, training.log_every, rank, world
        self.device = device
        self.peak = training.metrics.peak_flops_per_s
        self.flops = flops_per_token(model, training.seq_len)
        self.seconds: list[float] = []
        self.stream = MetricsStream(metrics_path, first_step) if metrics_path and rank == 0 else None
        self.board = _summary_writer(config) if rank == 0 else None

    def observe(self, record) -> None:
        """Complete ``record`` (a StepRecord) and report it. Every rank calls it: the
        peak memory is gathered from all."""
        self.seconds.append(record.seconds)
        record.peak_memory_bytes = self._gather_peaks()
        record.eta_s = statistics.fmean(self.seconds) * (self.steps - record.step)
        if self.peak:
            record.mfu = record.tokens_per_s / self.world * self.flops / self.peak
        if self.rank != 0:
            return
        if self.stream is not None:  # before the progress line: a printed step has its metrics line
            self.stream.write(record.__dict__)
        if self.board is not None:
            for key, value in record.__dict__.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.board.add_scalar(f"train/{key}", value, record.step)
            self.board.add_scalar("train/peak_memory_gib_max", max(record.peak_memory_bytes) / 2**30, record.step)
            self.board.flush()
        if record.step % self.log_every == 0 or record.step == self.steps:
            _LOG.info(self._line(record))

    def _line(self, record) -> str:
        mfu = f" | MFU {record.mfu:.1%}" if record.mfu is not None else ""
        evaluation = f" | eval loss {record.eval_loss:.6f}" if record.eval_loss is not None else ""
        return (f"step {record.step}/{self.steps} | loss {record.loss:.6f}{evaluation} | "
                f"grad norm {record.grad_norm:.4f} | lr {record.lr:.3g} | {record.tokens_per_s:,.0f} tok/s{mfu} | "
                f"peak mem {max(record.peak_memory_bytes) / 2**30:.2f} GiB | {record.seconds:.2f}s | "
                f"ETA {_duration(record.eta_s)}")

    def _gather_peaks(self) -> list[int]:
        """Every rank's peak memory, in rank order (one small all-gather on the run's
        device, read back once)."""
        mine = self.device.peak_memory_bytes()
        if self.world == 1:
            return [mine]
        device = self.device.device
        peaks = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world)]
        dist.all_gather(peaks, torch.tensor([mine], dtype=torch.int64, device=device))
        return [int(peak) for peak in to_host_list(torch.cat(peaks), [mine] * self.world)]

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.board is not None:
            self.board.close()


def _summary_writer(config):
    """TensorBoard's writer on ``training.metrics.tensorboard_dir`` (relative to the
    recipe's folder), or None when the recipe names none."""
    folder = config.training.metrics.tensorboard_dir
    if not folder:
        return None
    from torch.utils.tensorboard import SummaryWriter  # the metrics extra; checked at recipe load

    base = config.folder
    return SummaryWriter(log_dir=str(base / folder))


def _duration(seconds: float) -> str:
    """``1h02m``, ``3m04s`` or ``5s``."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
