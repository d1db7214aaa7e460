"""What a run writes besides checkpoints: the log, TensorBoard scalars, metrics.csv, summary.json.

Only rank 0 writes; other ranks get a `RunLog` whose writers are off.
"""
from __future__ import annotations

import csv
from contextlib import contextmanager
import logging
import math
import os
import sys
from pathlib import Path

from imgcls.core.outputs import write_json
from imgcls.rundir.curves import CurvesPicture
from imgcls.tasks import csv_metric_columns

log = logging.getLogger(__name__)

# metrics.csv: the run's columns, then every task's validation metrics (tasks/: those declared in_csv)
RUN_COLUMNS = ["epoch", "step", "lr", "train_loss", "train_samples_per_s", "data_wait_frac", "epoch_time_s"]
METRICS_COLUMNS = RUN_COLUMNS + csv_metric_columns() + ["skipped_files"]


_STDERR_LEVEL = [logging.NOTSET]   # the level of setup_logging's stderr handler (stderr_level changes it)


@contextmanager
def stderr_level(level: int):
    """Within the block, the runs set up by setup_logging show only records of `level` and above on stderr
    (their train.log keeps everything): audit.py's fold runs print their errors only."""
    previous, _STDERR_LEVEL[0] = _STDERR_LEVEL[0], level
    root = logging.getLogger()
    streams = [h for h in root.handlers if type(h) is logging.StreamHandler]
    levels = [h.level for h in streams]
    for h in streams:
        h.setLevel(level)
    try:
        yield
    finally:
        _STDERR_LEVEL[0] = previous
        for h, old in zip(streams, levels):
            h.setLevel(old)
        for h in logging.getLogger().handlers:
            if type(h) is logging.StreamHandler and h not in streams:
                h.setLevel(previous)


def setup_logging(run_dir: Path | None, is_main: bool) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.INFO if is_main else logging.WARNING)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    stream = logging.StreamHandler(sys.stderr)
    stream.setLevel(_STDERR_LEVEL[0])
    stream.setFormatter(fmt)
    root.addHandler(stream)
    if run_dir is not None and is_main:
        # opened at the first record: a run refused before it logs anything leaves no empty train.log (and
        # never touches another run's)
        file_handler = logging.FileHandler(run_dir / "train.log", delay=True)
        file_handler.setFormatter(fmt)
        root.addHandler(file_handler)


class RunLog:
    """The run's records: TensorBoard scalars, metrics.csv rows, summary.json, curves.png. `listeners` (the
    experiment tracking) subscribe to them: each gets the step lines (`log_step`), the news that last.pt holds
    the rows written so far (`log_epochs`), the run's end (`finish`) and its outcome (`close`)."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, curves: bool = False, listeners=()):
        self.run_dir = run_dir
        self.enabled = enabled
        self.listeners = tuple(listeners)
        self.status = "FAILED"  # the outcome the listeners hear at close, unless the run says otherwise
        self.curves = CurvesPicture(run_dir, enabled and curves)  # curves.png, from metrics.csv
        self.writer = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def scalars(self, values: dict, step: int) -> None:
        if self.writer is None:
            return
        for tag, value in values.items():
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(tag, value, step)

    def step_line(self, values: dict, step: int) -> None:
        """A step line's numbers."""
        self.scalars(values, step)
        for listener in self.listeners:
            listener.log_step(step, values)

    def checkpoint_saved(self) -> None:
        """last.pt now holds every metrics.csv row written so far."""
        for listener in self.listeners:
            listener.log_epochs()

    def finish(self, step: int, status: str = "FINISHED") -> None:
        """The run ended with `status` (FINISHED, or KILLED when a signal stopped it) at optimizer step `step`."""
        self.status = status
        if status == "FINISHED":
            for listener in self.listeners:
                listener.finish(step)

    def epoch_row(self, row: dict) -> None:
        if not self.enabled:
            return
        path = self.run_dir / "metrics.csv"
        columns = existing_columns(path)
        new = columns is None
        columns = columns or METRICS_COLUMNS
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, lineterminator="\n")
            if new:
                writer.writeheader()
            writer.writerow({k: _fmt(row.get(k)) for k in columns})

    def drop_epochs_from(self, epoch: int) -> None:
        """On resume: forget rows of epochs that will be run again (written after the checkpoint)."""
        path = self.run_dir / "metrics.csv"
        if not self.enabled or not path.exists():
            return
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            rows = [r for r in reader if r.get("epoch") and int(r["epoch"]) < epoch]
            columns = reader.fieldnames or METRICS_COLUMNS
        tmp = path.with_name(".metrics.csv.tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, path)

    def summary(self, payload: dict) -> None:
        if self.enabled:
            write_json(payload, self.run_dir / "summary.json")

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        self.curves.finish()
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        for listener in self.listeners:
            listener.close(self.status)
        self.listeners = ()


def existing_columns(path: Path) -> list[str] | None:
    """The header of a metrics.csv already there (a resumed run keeps the columns it started with, whatever
    this version would write), or None."""
    if not path.exists():
        return None
    with path.open(newline="") as f:
        return next(csv.reader(f), None)


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else value
