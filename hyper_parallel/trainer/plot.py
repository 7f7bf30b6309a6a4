"""``python -m hyper_parallel.trainer plot METRICS --out loss.png``: a run's curves from its
``--metrics`` file (trainer/metrics.py): training loss (and eval loss where recorded) and
tokens/s against the step, one PNG. Needs matplotlib (the ``metrics`` extra)."""

import argparse
import sys
from pathlib import Path

from hyper_parallel.errors import HyperParallelError
from hyper_parallel.trainer.metrics import read_metrics


def plot_main(argv: list[str]) -> int:
    """The plot subcommand; 0 when the picture is written, 2 with one line otherwise."""
    parser = argparse.ArgumentParser(
        prog="python -m hyper_parallel.trainer plot",
        description="Draw a run's loss (and eval loss) and tokens/s per step from its --metrics file into a PNG.")
    parser.add_argument("metrics", help="the file the trainer's --metrics wrote (JSON lines, one per step)")
    parser.add_argument("--out", required=True, help="the PNG to write, e.g. loss.png")
    parser.add_argument("--title", help="the figure's title (default: the metrics file's name)")
    args = parser.parse_args(argv)
    try:
        records = _records(Path(args.metrics))
        draw(records, Path(args.out), args.title or Path(args.metrics).name)
    except PlotError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"wrote {args.out} ({len(records)} steps)")
    return 0


class PlotError(ValueError, HyperParallelError):
    """A metrics file that cannot be drawn, or a picture that cannot be written."""


def _records(path: Path) -> list[dict]:
    """The step records of ``path`` that have a step and a loss; a missing, empty or
    malformed file is a PlotError naming it."""
    try:
        records = read_metrics(path)
    except FileNotFoundError:
        raise PlotError(f"{path}: metrics file not found (the trainer writes it with --metrics PATH)") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise PlotError(f"{path}: not a metrics file (JSON lines, one object per step): {exc}") from None
    records = [r for r in records if isinstance(r, dict) and "step" in r and "loss" in r]
    if not records:
        raise PlotError(f"{path}: no step records (a run writes one line per finished step)")
    return records


def draw(records: list[dict], out: Path, title: str) -> None:
    """Loss and eval loss on the left axis, tokens/s on the right, against the step."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError('matplotlib is not installed; pip install -c constraints.txt -e ".[metrics]"') from None
    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot

    steps = [r["step"] for r in records]
    figure, (loss_axis, speed_axis) = pyplot.subplots(2, 1, sharex=True, figsize=(8, 6))
    loss_axis.plot(steps, [r["loss"] for r in records], label="loss")
    evaluated = [r for r in records if r.get("eval_loss") is not None]
    if evaluated:
        loss_axis.plot([r["step"] for r in evaluated], [r["eval_loss"] for r in evaluated], "o-", label="eval loss")
    loss_axis.set_ylabel("loss")
    loss_axis.legend()
    loss_axis.set_title(title)
    speed_axis.plot(steps, [r.get("tokens_per_s", float("nan")) for r in records], color="tab:green")
    speed_axis.set_ylabel("tokens/s")
    speed_axis.set_xlabel("step")
    figure.tight_layout()
    try:
        figure.savefig(out, format="png")
    except OSError as exc:
        raise PlotError(f"{out}: cannot write the picture: {exc}") from None
    finally:
        pyplot.close(figure)


__all__ = ["plot_main", "draw", "PlotError"]
