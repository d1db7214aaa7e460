"""A training run's tracking: a listener of the run log (`rundir.runlog.RunLog`), told what it records where
it writes TensorBoard, metrics.csv and summary.json. Steps are optimizer steps.

- per logged step (output.log_interval): the step line's numbers (`train/loss`, `train/lr`, `train/grad_norm`,
  `train/samples_per_s`, ...);
- per epoch, once last.pt holds it: metrics.csv's new rows, each column a metric of the same name at the row's
  step. Reading the rows back from metrics.csv after the checkpoint makes the curve match the file: a run
  killed before the checkpoint drops and redoes the row (and logs it then); one killed after it logs the row
  when resumed (the store skips the (name, step) points the run already holds);
- at the end: summary.json's `best` as `best/<name>`, and config.yaml, summary.json, metrics.csv (and best.pt
  with tracking.log_checkpoints: best) as artifacts.

The run id goes into last.pt and best.pt (`tracking_run_id`), so --resume reopens the run and eval.py adds to it.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Optional

from imgcls.tracking.run_record import note_run_id, run_identity
from imgcls.tracking.run_tags import config_params, job_tags, resumed_job_tags
from imgcls.tracking.tracker import NullTracker, Tracker, finite_numbers, open_tracker

RUN_ID_KEY = "tracking_run_id"  # in last.pt and best.pt
# The first checkpoint waits this long for the run to exist, so that last.pt can name it (import and
# connection take seconds; an unreachable store fails sooner; training goes on meanwhile until that save)
RUN_ID_WAIT_S = 60.0


def metrics_csv_points(path: Path, after_step: int) -> list[tuple[int, dict]]:
    """(step, {column: value}) of metrics.csv's rows past `after_step`; empty cells are left out."""
    if not path.exists():
        return []
    points = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            try:
                step = int(row["step"])
            except (KeyError, TypeError, ValueError):
                continue
            if step > after_step:
                values = {}
                for key, text in row.items():
                    if key == "step":  # the points' step, not a curve
                        continue
                    try:
                        values[key] = float(text)
                    except (TypeError, ValueError):
                        pass
                points.append((step, finite_numbers(values)))
    return points


class TrainingTracking:
    def __init__(self, tracker: Tracker, run_dir: Path, log_checkpoints):
        self.tracker = tracker
        self.run_dir = Path(run_dir)
        self.log_checkpoints = log_checkpoints
        self.synced_step = -1  # metrics.csv rows up to this step were handed to the tracker
        self.enabled = not isinstance(tracker, NullTracker)  # rank 0 with tracking on
        self.waited = False

    def state_dict(self) -> Optional[str]:
        """The run id to write into a checkpoint (`tracking_run_id`); the first call waits for the run to exist
        (RUN_ID_WAIT_S). A resume reads it when it opens the tracking (`open_training_tracking`)."""
        if not self.waited:
            self.waited = True
            return self.tracker.wait_for_run(RUN_ID_WAIT_S)
        return self.tracker.run_id

    def log_step(self, step: int, values: dict) -> None:
        self.tracker.log_metrics(values, step)

    def log_epochs(self) -> None:
        """metrics.csv's rows not yet logged (call after last.pt holds them)."""
        if not self.enabled:
            return
        for step, values in metrics_csv_points(self.run_dir / "metrics.csv", self.synced_step):
            self.tracker.log_metrics(values, step)
            self.synced_step = step

    def finish(self, step: int) -> None:
        """summary.json's best, and the run's files."""
        if not self.enabled:
            return
        summary = self.run_dir / "summary.json"
        if summary.exists():
            best = json.loads(summary.read_text()).get("best") or {}
            self.tracker.log_metrics({f"best/{k}": v for k, v in best.items()}, step)
        for name in ("config.yaml", "summary.json", "metrics.csv"):
            if (self.run_dir / name).exists():
                self.tracker.log_artifact(self.run_dir / name)
        if self.log_checkpoints == "best" and (self.run_dir / "best.pt").exists():
            self.tracker.log_artifact(self.run_dir / "best.pt", "checkpoints")

    def load_state_dict(self, run_id) -> None:
        """The run id was read from last.pt when the tracking opened (before any part is restored)."""

    def close(self, status: str = "FAILED") -> None:
        self.tracker.close(status)


def open_training_tracking(cfg, run_dir: Path, is_main: bool, world_size: int, device: str,
                           fingerprint: Optional[dict], resume_ckpt: Optional[dict],
                           finetune_ckpt: Optional[dict], finetune_path: Optional[str]) -> TrainingTracking:
    """The run's tracking on global rank 0 (a no-op elsewhere): a new run, the run last.pt names (--resume),
    or a new one tagged with the run of the --finetune checkpoint."""
    if not is_main or cfg.tracking.backend == "none":
        return TrainingTracking(NullTracker(), run_dir, False)
    run_key, run_id = run_identity(run_dir, (resume_ckpt or {}).get(RUN_ID_KEY), resume_ckpt is not None)
    tags = job_tags(world_size, device, fingerprint)
    if resume_ckpt is not None:
        tags = resumed_job_tags(tags, resume_ckpt.get("step", 0))
    if finetune_ckpt is not None:
        tags["imgcls.finetune_of"] = finetune_path
        parent = finetune_ckpt.get(RUN_ID_KEY)
        if parent:
            tags["imgcls.parent_run_id"] = parent
            tags["mlflow.parentRunId"] = parent
    tracker = open_tracker(cfg.tracking, run_dir, cfg.source_name or "imgcls", Path(run_dir).resolve().name,
                           run_id, tags, run_key=run_key, reopen=resume_ckpt is not None,
                           on_started=lambda started: note_run_id(run_dir, run_key, started))
    tracking = TrainingTracking(tracker, run_dir, cfg.tracking.log_checkpoints)
    tracker.log_params(config_params(cfg.to_dict()))
    return tracking
