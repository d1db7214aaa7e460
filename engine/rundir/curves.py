"""curves.png: a run's training curves (Ultralytics' results.png counterpart), drawn from metrics.csv at
every epoch end: train and validation loss, the learning rate, and the validation metrics, per epoch. Written
to a temp file and renamed over the old picture, so a viewer never sees half a PNG; a failure to draw is
logged once and never stops training."""
from __future__ import annotations

import csv
import logging
import math
import os
from pathlib import Path

from tasks import TASKS

log = logging.getLogger(__name__)
CURVES_FILE = "curves.png"
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
    fig.tight_layout()
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
