"""curves.png: a run's training curves (Ultralytics' results.png counterpart), drawn from metrics.csv at
epoch ends: train and validation loss, the learning rate, and the validation metrics, per epoch. Written
to a temp file and renamed over the old picture, so a viewer never sees half a PNG; a failure to draw is
logged once and never stops training. A draw costs a few milliseconds (Pillow); `CurvesPicture` still
draws only where that stays under COST_SHARE of the run's time (a slow disk, a huge metrics.csv), and always
draws the last epoch when the run ends.

What a run writes besides checkpoints: the log, TensorBoard scalars, metrics.csv, summary.json.

Only rank 0 writes; other ranks get a `RunLog` whose writers are off."""
from __future__ import annotations

import csv
import logging
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from imgcls.core.files import write_json
from imgcls.tasks import TASKS, csv_metric_columns

log = logging.getLogger(__name__)


CURVES_FILE = "curves.png"


COST_SHARE = 0.02  # the most of a run's time redrawing curves.png may take (a redraw after every 6 s epoch costs 6%)


FIRST_DRAW_S = 0.02  # what the first draw is taken to cost before it is measured


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


WIDTH, HEIGHT = 960, 288          # three panels of 320 x 288


COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


LEFT, RIGHT, TOP, BOTTOM = 56, 10, 26, 38  # a panel's margins: tick labels, title, epoch axis


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round values (1, 2 or 5 x a power of ten apart) covering [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low] if math.isfinite(low) else []
    raw = (high - low) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    return [round(first + i * step, 12) for i in range(int((high - first) / step + 1e-9) + 1)]


def log_ticks(low: float, high: float) -> list[float]:
    """Tick positions (log10 of the values) on a log axis over [low, high] (log10 units): the powers of ten,
    and 2x and 5x them where fewer than three powers fall inside."""
    decades = range(math.floor(low), math.ceil(high) + 1)
    ticks = [float(d) for d in decades if low <= d <= high]
    if len(ticks) < 3:
        ticks = sorted(d + math.log10(m) for d in decades for m in (1, 2, 5) if low <= d + math.log10(m) <= high)
    return ticks


def tick_text(value: float) -> str:
    return f"{value:.3g}" if value != 0 else "0"


def drawable(value: float, log_scale: bool) -> bool:
    """A value that has a place on the axis: finite, and positive on a log scale."""
    return math.isfinite(value) and (value > 0 or not log_scale)


def value_range(series: list[list[float]], log_scale: bool) -> tuple[float, float]:
    """The drawable values' extent, padded 5%; (0, 1) when there are none."""
    values = [v for line in series for v in line if drawable(v, log_scale)]
    if not values:
        return (0.0, 1.0)
    low, high = min(values), max(values)
    if log_scale:
        low, high = math.log10(low), math.log10(high)
    pad = (high - low) * 0.05 or max(abs(high) * 0.05, 0.5)
    return (low - pad, high + pad)


def polyline(draw, points: list[tuple[float, float]], colour: str, dashed: bool, dash: float = 6.0,
             gap: float = 5.0) -> None:
    """A 2-px line through `points`; `dashed`: `dash` px drawn, `gap` px left out, along its whole length (a
    line over another one then leaves the one beneath visible in its gaps)."""
    if not dashed:
        draw.line(points, fill=colour, width=2)
        return
    period, travelled = dash + gap, 0.0
    for (xa, ya), (xb, yb) in zip(points, points[1:]):
        length = math.hypot(xb - xa, yb - ya)
        t = 0.0
        while t < length:
            phase = (travelled + t) % period
            step = min((dash - phase) if phase < dash else (period - phase), length - t)
            if phase < dash and step > 0:
                a, b = t / length, (t + step) / length
                draw.line([(xa + a * (xb - xa), ya + a * (yb - ya)), (xa + b * (xb - xa), ya + b * (yb - ya))],
                          fill=colour, width=2)
            t += max(step, 1e-6)
        travelled += length


def mark_coinciding(lines: list[tuple], tolerance: float = 0.05) -> list[tuple]:
    """The lines with, for each one that runs within `tolerance` of an earlier one at every epoch where both
    have a value (mean class accuracy over top-1 on a balanced split), "(= that one)" added to its label and a
    dashed stroke, so both stay visible."""
    out = []
    for i, (label, values, colour) in enumerate(lines):
        twin = next((other for other, earlier, _ in lines[:i]
                     if any(math.isfinite(a) and math.isfinite(b) for a, b in zip(values, earlier))
                     and all(abs(a - b) <= tolerance for a, b in zip(values, earlier)
                             if math.isfinite(a) and math.isfinite(b))), None)
        out.append((f"{label} (= {twin}, dashed)", values, colour, True) if twin else (label, values, colour, False))
    return out


def warmup_note(run_dir: Path, columns: dict[str, list[float]]) -> str | None:
    """A line for the LR panel when the run's warmup (config.yaml's schedule.warmup_epochs) is longer than the
    run (train.epochs): its LR climbs to the end and never reaches the peak."""
    import yaml

    try:
        cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}
        warmup = float(cfg["schedule"]["warmup_epochs"])
        epochs = float(cfg["train"]["epochs"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None
    if warmup < epochs or not columns.get("lr"):
        return None
    return f"warmup {warmup:g} ep >= run's {epochs:g} ep: no peak LR"


def draw_panel(draw, font, box: tuple[int, int, int, int], title: str, epochs: list[float],
               lines: list[tuple], log_scale: bool = False, note: str | None = None) -> None:
    """One panel in `box` (left, top, right, bottom of the panel): its frame, grid and ticks, the `lines`
    (label, values per epoch, colour, and optionally dashed; a value that is not finite breaks the line),
    their legend, and a `note` written under the title."""
    x0, y0, x1, y1 = box[0] + LEFT, box[1] + TOP, box[2] - RIGHT, box[3] - BOTTOM
    draw.text(((box[0] + box[2]) / 2 + LEFT / 2, box[1] + 6), title, fill="#222222", font=font, anchor="mt")
    first, last = (min(epochs), max(epochs)) if epochs else (0.0, 1.0)
    if last <= first:
        first, last = first - 0.5, last + 0.5
    low, high = value_range([line[1] for line in lines], log_scale)

    def point(epoch: float, value: float) -> tuple[float, float]:
        v = math.log10(value) if log_scale else value
        return (x0 + (epoch - first) / (last - first) * (x1 - x0), y1 - (v - low) / (high - low) * (y1 - y0))

    y_ticks = [t for t in (log_ticks(low, high) if log_scale else nice_ticks(low, high, 6)) if low <= t <= high]
    for t in y_ticks:
        y = y1 - (t - low) / (high - low) * (y1 - y0)
        draw.line([(x0, y), (x1, y)], fill="#e6e6e6")
        draw.text((x0 - 4, y), tick_text(10 ** t if log_scale else t), fill="#444444", font=font, anchor="rm")
    for t in nice_ticks(first, last, 6):
        if first <= t <= last and float(t).is_integer():
            x = x0 + (t - first) / (last - first) * (x1 - x0)
            draw.line([(x, y0), (x, y1)], fill="#e6e6e6")
            draw.text((x, y1 + 4), str(int(t)), fill="#444444", font=font, anchor="mt")
    draw.text(((x0 + x1) / 2, y1 + 20), "epoch", fill="#444444", font=font, anchor="mt")
    draw.rectangle([x0, y0, x1, y1], outline="#555555")
    if note:
        draw.text((x0 + 4, y0 + 4), note, fill="#b00020", font=font, anchor="lt")
    for label, values, colour, *style in lines:
        dashed = bool(style and style[0])
        run: list[tuple[float, float]] = []
        for epoch, value in list(zip(epochs, values)) + [(math.nan, math.nan)]:
            if drawable(value, log_scale):
                run.append(point(epoch, value))
                continue
            if len(run) > 1:
                polyline(draw, run, colour, dashed)
            for x, y in run:
                r = 1.5 if dashed else 2.5
                draw.ellipse([x - r, y - r, x + r, y + r], fill=colour)
            run = []
    named = [(line[0], line[2], bool(line[3:] and line[3])) for line in lines if line[0]]
    if named:
        points = [point(e, v) for _, values, *_ in lines for e, v in zip(epochs, values)
                  if drawable(v, log_scale)]
        w = 30 + max(font.getlength(label) for label, *_ in named)
        h = 6 + 14 * len(named)
        corners = [(x1 - 4 - w, y0 + 4), (x1 - 4 - w, y1 - 4 - h), (x0 + 4, y0 + 4), (x0 + 4, y1 - 4 - h)]
        left, top = min(corners, key=lambda c: sum(c[0] <= x <= c[0] + w and c[1] <= y <= c[1] + h
                                                   for x, y in points))  # the corner the lines cross least
        draw.rectangle([left, top, left + w, top + h], fill="white", outline="#cccccc")
        for row, (label, colour, dashed) in enumerate(named):
            y = top + 10 + 14 * row
            polyline(draw, [(left + 6, y), (left + 22, y)], colour, dashed, dash=4.0, gap=3.0)
            draw.text((left + 26, y), label, fill="#222222", font=font, anchor="lm")


def draw_curves(columns: dict[str, list[float]], path: Path, lr_note: str | None = None) -> Path:
    """Three panels over the epochs: losses, LR (log scale, with `lr_note` written in it), validation metrics
    (one that coincides with another dashed); written atomically. Drawn with Pillow (a few milliseconds):
    matplotlib's import and draw took 0.7 s of every run's end."""
    from PIL import Image, ImageDraw, ImageFont

    epochs = columns.get("epoch", [])
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=11)
    width = WIDTH // 3

    def present(key: str) -> bool:
        return any(math.isfinite(v) for v in columns.get(key, []))

    losses = [(name, columns[key], COLOURS[i]) for i, (key, name) in
              enumerate((("train_loss", "train loss"), ("val_loss", "val loss"))) if present(key)]
    draw_panel(draw, font, (0, 0, width, HEIGHT), "loss", epochs, losses)
    lrs = [("", columns["lr"], COLOURS[4])] if any(drawable(v, True) for v in columns.get("lr", [])) else []
    draw_panel(draw, font, (width, 0, 2 * width, HEIGHT), "learning rate (epoch end)", epochs, lrs, log_scale=True,
               note=lr_note)
    metrics = [(key.removeprefix("val_"), columns[key], COLOURS[i % len(COLOURS)])
               for i, key in enumerate(k for k in metric_columns() if present(k))]
    draw_panel(draw, font, (2 * width, 0, WIDTH, HEIGHT), "validation metrics (%)", epochs, mark_coinciding(metrics))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    image.save(tmp, format="PNG")
    os.replace(tmp, path)
    return path


def write_curves(run_dir: Path, enabled: bool) -> None:
    """The reporter's one call at each epoch end (main process, output.curves): curves.png from metrics.csv."""
    metrics = Path(run_dir) / "metrics.csv"
    if not enabled or not metrics.exists():
        return
    try:
        columns = read_columns(metrics)
        draw_curves(columns, Path(run_dir) / CURVES_FILE, warmup_note(run_dir, columns))
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
