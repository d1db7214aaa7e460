"""curves.png: a run's training curves (Ultralytics' results.png counterpart), drawn from metrics.csv at
epoch ends: train and validation loss, the learning rate, and the validation metrics, per epoch. Written
to a temp file and renamed over the old picture, so a viewer never sees half a PNG; a failure to draw is
logged once and never stops training. A draw costs about 0.25 s (the first, which imports matplotlib,
about 0.8 s): `CurvesPicture` draws only where that stays under COST_SHARE of the run's time, so short
epochs skip draws (a run under FIRST_DRAW_S / COST_SHARE draws once, at its end), and always draws the last
epoch when the run ends."""
from __future__ import annotations

import csv
import logging
import math
import os
import time
from pathlib import Path

from tasks import TASKS

log = logging.getLogger(__name__)
CURVES_FILE = "curves.png"
COST_SHARE = 0.02  # the most of a run's time redrawing curves.png may take (6 s epochs: 2.8 s of 47 s before)
FIRST_DRAW_S = 0.8  # what the first draw is taken to cost before it is measured (it imports matplotlib)
_warned = []


def metric_columns() -> list[str]:
    """The validation metrics drawn when metrics.csv holds them: every task's declared percentage columns."""
    names = [m.name for task in TASKS.values() for m in task.metrics if m.in_csv and m.percent]
    return [f"val_{name}" for name in dict.fromkeys(names)]


def read_columns(path: Path) -> dict[str, list[float]]:
    """metrics.csv as columns of floats (nan where a cell is empty: an epoch without validation)."""
    columns: dict[str, list[float]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            for key, text in row.items():
                try:
                    value = float(text) if text not in (None, "") else math.nan
                except ValueError:
                    value = math.nan
                columns.setdefault(key, []).append(value)
    return columns


def draw_curves(columns: dict[str, list[float]], path: Path) -> Path:
    """Three panels over the epochs: losses, LR (log scale), validation metrics; written atomically."""
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    epochs = columns.get("epoch", [])
    fig = Figure(figsize=(12, 3.6), dpi=80)
    loss_ax, lr_ax, metric_ax = fig.subplots(1, 3)
    for key, name in (("train_loss", "train loss"), ("val_loss", "val loss")):
        if any(math.isfinite(v) for v in columns.get(key, [])):
            loss_ax.plot(epochs, columns[key], marker=".", label=name)
    loss_ax.set_title("loss")
    lrs = columns.get("lr", [])
    if any(math.isfinite(v) and v > 0 for v in lrs):
        lr_ax.plot(epochs, lrs, marker=".", color="tab:purple")
        lr_ax.set_yscale("log")
    lr_ax.set_title("learning rate (epoch end)")
    for key in metric_columns():
        if any(math.isfinite(v) for v in columns.get(key, [])):
            metric_ax.plot(epochs, columns[key], marker=".", label=key.removeprefix("val_"))
    metric_ax.set_title("validation metrics (%)")
    for ax in (loss_ax, lr_ax, metric_ax):
        ax.set_xlabel("epoch")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.14, top=0.91, wspace=0.22)  # tight_layout: 0.15 s a draw
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def write_curves(run_dir: Path, enabled: bool) -> None:
    """The reporter's one call at each epoch end (main process, output.curves): curves.png from metrics.csv."""
    metrics = Path(run_dir) / "metrics.csv"
    if not enabled or not metrics.exists():
        return
    try:
        draw_curves(read_columns(metrics), Path(run_dir) / CURVES_FILE)
    except Exception as err:  # noqa: BLE001 - a picture must never stop a training run
        if not _warned:
            _warned.append(True)
            log.warning("could not draw %s: %s (training goes on)", CURVES_FILE, err)


class CurvesPicture:
    """curves.png kept current at a bounded cost: at an epoch end it is redrawn when the time since the last
    draw (or since the run began) is at least that draw's cost (FIRST_DRAW_S before the first) / COST_SHARE;
    `finish` draws the epochs not drawn yet when the run ends or stops."""

    def __init__(self, run_dir: Path, enabled: bool, clock=time.monotonic):
        self.run_dir, self.enabled, self.clock = Path(run_dir), enabled, clock
        self.last_end = clock()
        self.last_cost = FIRST_DRAW_S
        self.stale = False

    def epoch_end(self) -> None:
        """The epoch's row is in metrics.csv."""
        self.stale = True
        if self.clock() - self.last_end >= self.last_cost / COST_SHARE:
            self._draw()

    def finish(self) -> None:
        if self.stale:
            self._draw()

    def _draw(self) -> None:
        start = self.clock()
        write_curves(self.run_dir, self.enabled)
        self.last_end = self.clock()
        self.last_cost, self.stale = self.last_end - start, False
