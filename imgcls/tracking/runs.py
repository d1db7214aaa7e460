"""`<run dir>/tracking_run.json`: the run's client-side key and, once a store created or found it, the run id.

The key is made when a run starts tracking and kept across --resume, so every record of every job of the run
can be put into one tracking run, even when the store was down the whole time: the run is created with the
tag `imgcls.run_key` (tracking.tracker), and a later job or replay finds it again by that tag or by the
run id written here. Written atomically (a reader never sees half a file).

What a tracked run records about itself: the config as parameters, and tags naming the code, the data,
the processes and the command line.

A training run's tracking: a listener of the run log (`training.runlog.RunLog`), told what it records where
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

eval.py's tracking: the figures of `eval.py --checkpoint best.pt ... tracking.backend=mlflow` go into the
training run that wrote the checkpoint (its `tracking_run_id`), as `eval/<name>` at the checkpoint's step,
with the report files as artifacts under eval/. The run's status stays as it is.

Only when the user asks on eval.py's command line: the store is their `tracking.uri` (else MLflow's own
resolution, MLFLOW_TRACKING_URI), never the one a checkpoint's config names: a file someone gives you must
not make eval.py send its results (and the data's paths) anywhere.

tune.py's tracking: a run of its own per sweep or LR range test, with the config as parameters, the table
as metrics (a sweep's rows at step = effective batch; the LR range test's loss at each step) and its JSON
and plot as artifacts.

tune.py --search's tracking: one run for the study (the trials' values and results as metrics at step = the
trial's number, trials.csv, best.yaml and the plots as artifacts), and each trial's own training run nested
under it: the trial's train.py gets the study's run id in PARENT_RUN_ENV and tags its run with it."""
from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

from imgcls.config import flatten
from imgcls.core.files import write_json
from imgcls.tracking.tracker import NullTracker, Tracker, check_store_apart_from, finite_numbers, open_tracker

RECORD_NAME = "tracking_run.json"


def read_run_record(run_dir: Path) -> dict:
    """{"run_key": ..., "run_id": ...} of the run directory ({} when there is none or it is unreadable)."""
    try:
        record = json.loads((Path(run_dir) / RECORD_NAME).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict) or not isinstance(record.get("run_key"), str):
        return {}
    if not isinstance(record.get("run_id"), (str, type(None))):
        record["run_id"] = None
    return record


def write_run_record(run_dir: Path, run_key: str, run_id: Optional[str]) -> None:
    write_json({"run_key": run_key, "run_id": run_id}, Path(run_dir) / RECORD_NAME)


def note_run_id(run_dir: Path, run_key: str, run_id: Optional[str]) -> None:
    """Record that `run_key`'s run is `run_id`, when the folder's record is this key's (a tune.py or eval.py
    job's run is another, found again by its tag)."""
    recorded = read_run_record(run_dir)
    if run_id and recorded.get("run_key") == run_key and recorded.get("run_id") != run_id:
        write_run_record(run_dir, run_key, run_id)


def run_identity(run_dir: Path, checkpoint_run_id: Optional[str], resumed: bool) -> tuple[str, Optional[str]]:
    """(run key, run id) of a training job, written to the run directory before the store is asked: the
    checkpoint's run id, else (resumed) the one recorded here since (a replay created the run)."""
    recorded = read_run_record(run_dir) if resumed else {}
    run_key = recorded.get("run_key") or uuid.uuid4().hex
    run_id = checkpoint_run_id or recorded.get("run_id")
    write_run_record(run_dir, run_key, run_id)
    return run_key, run_id

CODE_DIR = Path(__file__).resolve().parents[2]  # the checkout holding imgcls/ (no .git for an installed copy)


# set by tune.py --search for its trials: the study's run, which each trial's run is nested under
PARENT_RUN_ENV = "IMGCLS_TRACKING_PARENT_RUN_ID"


def config_params(config: dict) -> dict:
    """The resolved config as parameters: dotted keys, as config.yaml nests them."""
    return {key: json.dumps(value) if isinstance(value, (list, dict)) else str(value)
            for key, value in flatten(config).items()}


def git_commit(code_dir: Path = CODE_DIR) -> Optional[str]:
    """The checkout's commit (with `-dirty` when tracked files changed); None when the code is not a git
    checkout or git is missing."""
    if not (code_dir / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(code_dir), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(code_dir), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def fingerprint_digest(fingerprint: Optional[dict]) -> Optional[str]:
    """A short digest of the splits' fingerprint (data.listing): equal digests, equal files."""
    if not fingerprint:
        return None
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def job_tags(world_size: int, device: str, fingerprint: Optional[dict] = None,
             argv: Optional[list[str]] = None) -> dict:
    import timm
    import torch

    argv = sys.argv if argv is None else argv
    tags = {"imgcls.command": shlex.join(argv), "mlflow.source.name": Path(argv[0]).name if argv else "",
            "imgcls.world_size": world_size, "imgcls.device": device, "imgcls.torch_version": torch.__version__,
            "imgcls.timm_version": timm.__version__}
    commit = git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    digest = fingerprint_digest(fingerprint)
    if digest:
        tags["imgcls.data_fingerprint"] = digest
    if os.environ.get(PARENT_RUN_ENV):
        tags["mlflow.parentRunId"] = os.environ[PARENT_RUN_ENV]
    return tags


def resumed_job_tags(tags: dict, step: int) -> dict:
    """A resumed job's tags: its command line as `imgcls.resume_command`, so that the run's `imgcls.command`
    (and source name) stay the command that started it; `imgcls.resumed_at_step`."""
    tags = dict(tags)
    tags["imgcls.resume_command"] = tags.pop("imgcls.command")
    tags.pop("mlflow.source.name", None)
    tags["imgcls.resumed_at_step"] = step
    return tags


def flat_numbers(values: dict, prefix: str = "") -> dict:
    """The finite numbers in `values` (nested dicts flattened with '/'), under `prefix`."""
    import math

    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(flat_numbers(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[f"{prefix}{key}"] = float(value)
    return out

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

log = logging.getLogger(__name__)


def asked_tracking(overrides: list[str]):
    """The tracking.* of eval.py's command line (defaults for the rest, none from the checkpoint); None unless
    they turn tracking on. ConfigError (exit 2) for a bad value."""
    from imgcls.config import Config, apply_overrides
    from imgcls.tracking.settings import check_tracking

    cfg = Config()
    apply_overrides(cfg, [o for o in overrides if o.split("=", 1)[0].strip().startswith("tracking.")])
    check_tracking(cfg.tracking)
    return cfg.tracking if cfg.tracking.backend != "none" else None


def check_eval_tracking(overrides: list[str], checkpoint: str, data: Optional[str]) -> None:
    """Before any work (exit 2): the client is installed and can open the store asked for, which lies apart
    from the checkpoint and the data."""
    from imgcls.tracking.tracker import check_tracking_client

    tracking = asked_tracking(overrides)
    if tracking is None:
        return
    check_tracking_client(tracking)
    check_store_apart_from(tracking, {"checkpoint": [checkpoint], "data list": [data] if data else []},
                           {"checkpoint folder": [checkpoint], "data root": [data] if data else []})


def checkpoint_run(path: Path) -> Optional[tuple[str, int]]:
    """(tracking run id, step) of a train.py checkpoint; None for a model file without a run (an export, a
    checkpoint of an untracked run)."""
    import torch

    if not (path.is_file() and path.suffix == ".pt"):
        return None
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    run_id = ckpt.get(RUN_ID_KEY) if isinstance(ckpt, dict) else None
    if not isinstance(run_id, str) or not run_id:
        return None
    step = ckpt.get("step")
    return run_id, step if isinstance(step, int) and not isinstance(step, bool) else 0


def log_evaluation(checkpoint: str, overrides: list[str], figures: dict, files: list[Optional[str]]) -> None:
    """Add `figures` (nested numbers are flattened: eval/selective/coverage) and `files` to the checkpoint's run,
    when eval.py's command line turns tracking on."""
    tracking = asked_tracking(overrides)
    found = checkpoint_run(Path(checkpoint))
    if found is None:
        if tracking is not None:
            log.warning("tracking: %s names no tracking run (an export, or a run trained without tracking); the "
                        "figures are not logged", checkpoint)
        return
    run_id, step = found
    if tracking is None:
        log.info("tracking: %s belongs to tracking run %s; to add these figures to it, pass tracking.backend=mlflow "
                 "(and tracking.uri=STORE, the store it was trained with)", checkpoint, run_id)
        return
    # one try per record: a store that does not answer costs one request timeout, not three
    tracker = open_tracker(tracking, Path(checkpoint).parent, "imgcls", None, run_id, attach_only=True, attempts=1)
    tracker.log_metrics(flat_numbers(figures, "eval/"), step)
    for file in files:
        if file and Path(file).is_file():
            tracker.log_artifact(file, "eval")
    tracker.close()
    if tracker.all_sent:
        log.info("tracking: eval/ figures added to run %s", run_id)
    else:
        backlog = tracker.sender.backlog.path
        log.warning("tracking: the eval/ figures did not reach run %s; they are in %s (send them with python -m "
                    "tracking.replay %s --uri STORE; only files inside that folder are uploaded)", run_id, backlog,
                    backlog.parent)

def log_tune_run(cfg, kind: str, doc: dict, files: list[Optional[str]], world_size: int, device: str) -> None:
    """`kind`: sweep | lr_range. The backlog, if the store is away, goes beside the JSON (else here)."""
    if cfg.tracking.backend == "none":
        return
    json_path = next((f for f in files if f and f.endswith(".json")), None)
    backlog_dir = Path(json_path).resolve().parent if json_path else Path.cwd()
    run_name = f"tune-{kind}-{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    tracker = open_tracker(cfg.tracking, backlog_dir, cfg.source_name or "imgcls", run_name,
                           tags={**job_tags(world_size, device), "imgcls.tune": kind})
    tracker.log_params(config_params(cfg.to_dict()))
    if kind == "sweep":
        for row in doc["rows"]:
            tracker.log_metrics(flat_numbers(row, "sweep/"), int(row["effective_batch"]))
        tracker.log_metrics(flat_numbers({"steps": doc["steps"], "target_loss": doc["target_loss"]}, "sweep/"), 0)
    else:
        for step, (lr, loss) in enumerate(zip(doc["lrs"], doc["smoothed_loss"])):
            tracker.log_metrics({"lr_range/lr": lr, "lr_range/smoothed_loss": loss}, step)
        tracker.log_metrics(flat_numbers({k: v for k, v in doc.items() if not isinstance(v, list)}, "lr_range/"), 0)
    for file in files:
        if file and Path(file).is_file():
            tracker.log_artifact(file)
    tracker.close()


RUN_START_TIMEOUT_S = 60.0  # the store creates the run in the background; trials wait this long to nest under it


class StudyTracking:
    def __init__(self, tracking_cfg, study_dir: Path, experiment: str, run_id: Optional[str]):
        self.tracker = open_tracker(tracking_cfg, study_dir, experiment, f"search-{study_dir.resolve().name}",
                                    run_id, tags={"imgcls.search": str(study_dir)})
        self.run_id = self.tracker.wait_for_run(RUN_START_TIMEOUT_S) if tracking_cfg.backend != "none" else None
        if tracking_cfg.backend != "none" and self.run_id is None:
            log.warning("search: the tracking store did not open the study's run within %.0f s: the trials' runs "
                        "are not nested under it", RUN_START_TIMEOUT_S)

    def trial_environment(self) -> dict:
        return {PARENT_RUN_ENV: self.run_id} if self.run_id else {}

    def log_trial(self, number: int, values: dict, state: str, value: Optional[float]) -> None:
        numbers = {f"search/{k}": v for k, v in values.items() if isinstance(v, (int, float))}
        self.tracker.log_metrics({**numbers, "search/value": value, "search/complete": float(state == "COMPLETE"),
                                  "search/pruned": float(state == "PRUNED")}, number)

    def close(self, files: list[Path], finished: bool) -> None:
        for path in files:
            if path.is_file():
                self.tracker.log_artifact(path)
        self.tracker.close("FINISHED" if finished else "KILLED")
