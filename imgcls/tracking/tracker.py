"""The narrow interface jobs report to (`Tracker`), its no-op form for `tracking.backend: none` and for
every rank but global rank 0, and the MLflow form (queued; never blocks, never fails the job)."""
from __future__ import annotations

import math
import time
import uuid
from pathlib import Path
from typing import Optional, Protocol

from imgcls.tracking.backlog import BACKLOG_NAME, Backlog
from imgcls.tracking.sender import ATTEMPTS, Sender

CLOSE_TIMEOUT_S = 30.0  # at the end, the job waits for queued records while the store answers within this


class Tracker(Protocol):
    run_id: Optional[str]

    def log_params(self, params: dict) -> None: ...

    def set_tags(self, tags: dict) -> None: ...

    def log_metrics(self, metrics: dict, step: int) -> None: ...

    def log_artifact(self, path: str | Path, artifact_path: Optional[str] = None) -> None: ...

    def close(self, status: str = "FINISHED") -> None: ...

    def wait_for_run(self, timeout_s: float) -> Optional[str]: ...


class NullTracker:
    """Records nothing (tracking.backend: none, and the ranks that are not global rank 0)."""

    run_id = None

    def log_params(self, params: dict) -> None:
        pass

    def set_tags(self, tags: dict) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: Optional[str] = None) -> None:
        pass

    def close(self, status: str = "FINISHED") -> None:
        pass

    def wait_for_run(self, timeout_s: float) -> Optional[str]:
        return None


class MlflowTracker:
    """An MLflow run: created (or reopened, given `run_id`) by the sender thread; `run_id` is None until the
    store answered. Every call returns at once."""

    def __init__(self, uri: Optional[str], backlog_dir: Path, experiment: str, run_name: Optional[str],
                 run_id: Optional[str] = None, tags: Optional[dict] = None,
                 close_timeout_s: float = CLOSE_TIMEOUT_S, attach_only: bool = False, run_key: Optional[str] = None,
                 reopen: Optional[bool] = None, on_started=None, attempts: int = ATTEMPTS):
        """`run_id`: reopen that run (--resume: its status goes back to RUNNING and close() ends it again);
        with `attach_only` only add to it (eval.py: the run's status stays as it is). `run_key`: the run's
        client-side key (tracking.run_record), which finds the run again when `run_id` is unknown; `reopen`
        (default: given a run id): a resumed job's run goes back to RUNNING. `on_started(run_id)` is called
        once the store created or opened the run; `attempts`: tries per record."""
        from imgcls.tracking.mlflow_store import MlflowStore

        self.store = MlflowStore(uri)
        self.sender = Sender(self.store, Backlog(Path(backlog_dir) / BACKLOG_NAME), attempts=attempts,
                             on_started=on_started)
        self.session = uuid.uuid4().hex  # names this job's records in the backlog
        self.run_key = run_key or self.session
        self.close_timeout_s = close_timeout_s
        self.closed = False
        self.attach_only = attach_only
        reopen = bool(run_id) if reopen is None else reopen
        self._submit({"op": "start", "run_id": run_id, "reopen": reopen and not attach_only,
                      "attach_only": attach_only, "experiment": experiment, "run_name": run_name,
                      "tags": {k: str(v) for k, v in (tags or {}).items()}})

    @property
    def run_id(self) -> Optional[str]:
        """The store's run; while the store has not answered, the run the job was started for (--resume:
        last.pt's), which the checkpoints go on naming."""
        return self.store.run_id or self.sender.run_id_named

    @property
    def all_sent(self) -> bool:
        """Whether every record so far reached the store (after close(): nothing went to the backlog)."""
        return self.sender.backlog.written == 0 and self.store.run_id is not None

    def _submit(self, record: dict) -> None:
        self.sender.submit({**record, "session": self.session, "run_key": self.run_key})

    def log_params(self, params: dict) -> None:
        self._submit({"op": "params", "params": {k: str(v) for k, v in params.items()}})

    def set_tags(self, tags: dict) -> None:
        self._submit({"op": "tags", "tags": {k: str(v) for k, v in tags.items()}})

    def log_metrics(self, metrics: dict, step: int) -> None:
        values = finite_numbers(metrics)
        if values:
            self._submit({"op": "metrics", "step": int(step), "timestamp": int(time.time() * 1000),
                          "metrics": values})

    def log_artifact(self, path: str | Path, artifact_path: Optional[str] = None) -> None:
        self._submit({"op": "artifact", "path": str(Path(path).resolve()), "artifact_path": artifact_path})

    def wait_for_run(self, timeout_s: float) -> Optional[str]:
        """The run id, once the store created or reopened the run (else, after `timeout_s`, the run the job
        was started for, or None for a new run)."""
        self.sender.started.wait(timeout_s)
        return self.run_id

    def close(self, status: str = "FINISHED") -> None:
        if not self.closed:
            self.closed = True
            if not self.attach_only:
                self._submit({"op": "end", "status": status})
            self.sender.close(self.close_timeout_s)


def finite_numbers(values: dict) -> dict:
    """The entries that are finite numbers, as floats (None, NaN and text are not points on a curve)."""
    out = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def open_tracker(tracking_cfg, backlog_dir: Path, experiment: str, run_name: Optional[str],
                 run_id: Optional[str] = None, tags: Optional[dict] = None, enabled: bool = True,
                 attach_only: bool = False, **options) -> Tracker:
    """The tracker `tracking.backend` asks for; a NullTracker when it is none or `enabled` is false (the
    ranks other than global rank 0). `options`: MlflowTracker's run_key, reopen, on_started, attempts."""
    if tracking_cfg.backend == "none" or not enabled:
        return NullTracker()
    return MlflowTracker(tracking_cfg.uri, backlog_dir, tracking_cfg.experiment or experiment,
                         tracking_cfg.run_name or run_name, run_id, tags, attach_only=attach_only, **options)
