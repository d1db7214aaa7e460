"""Where a local tracking store writes (a folder store, a SQLite file), kept apart from what the job reads:
MLflow writes `.trash` and experiment folders into a folder store, which among class folders breaks the next
run. The outputs-apart rule (core.files.check_outputs_apart), with the store as the output.

The backlog: records that could not be sent, one JSON object a line in `<run dir>/tracking_backlog.jsonl`.

A record is a plain dict with an `op`: `start` (open or create the run), `params`, `tags`, `metrics` (`step`,
`timestamp` in ms, `metrics`: name -> value), `artifact` (`path`, `artifact_path`) or `end` (`status`). Each
carries `run_key`: the run it belongs to, as the client knows it (tracking.runs; the same across the
jobs of a resumed run), `run_id`: the store's id of that run when known, or null when the run had not been
created yet (then it belongs to the run that its `start` record creates or finds on replay), and `session`:
the job (one tracker) it came from.

The background sender: records go into a bounded queue and one thread sends them, so the job never waits
on the tracking store. A record that fails is retried a few times; then it goes to the backlog, the store
counts as down for a while (records meanwhile go straight to the backlog), and a warning says so at most
once a minute. A run that could not be created at all sends nothing more: its records all go to the backlog,
which creates the run on replay.

Records (tracking.tracker) applied to an MLflow tracking store through `MlflowClient`: the one place that
calls MLflow. Used by the sender thread during a job and by `python -m imgcls.tracking.replay` after it.

The narrow interface jobs report to (`Tracker`), its no-op form for `tracking.backend: none` and for
every rank but global rank 0, and the MLflow form (queued; never blocks, never fails the job)."""
from __future__ import annotations

import json
import logging
import math
import os
import queue
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Optional, Protocol
from urllib.parse import unquote, urlsplit

from imgcls.core.errors import ConfigError, install_log_redaction, redact_text, redact_uri
from imgcls.core.files import check_outputs_apart
from imgcls.tracking.settings import TrackingConfig, tracking_client_installed


def local_store(uri: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(folder, file) a tracking URI writes on this machine: a folder store's folder, a SQLite store's file;
    (None, None) for a server or a remote database."""
    if not uri:
        return None, None
    if is_folder_uri(uri):
        if uri.lower().startswith("file:"):
            return unquote(urlsplit(uri).path) or None, None
        return uri, None
    if uri.lower().startswith("sqlite:///"):
        return None, unquote(uri[len("sqlite:///"):].split("?", 1)[0]) or None
    return None, None


def _existing(*paths: Optional[str]) -> list[str]:
    return [p for p in paths if p and os.path.exists(p)]


def _parent_dirs(*files: Optional[str]) -> list[str]:
    return [str(Path(f).expanduser().resolve().parent) for f in files if f and os.path.isfile(f)]


def _shard_dirs(patterns) -> list[str]:
    """The folders of the shard patterns (`dir/train-{000..009}.tar`, lists of them)."""
    if isinstance(patterns, str):
        patterns = [patterns]
    dirs = []
    for pattern in patterns or ():
        folder = os.path.dirname(re.split(r"[{*?\[]", str(pattern), maxsplit=1)[0])
        if folder and os.path.isdir(folder):
            dirs.append(folder)
    return dirs


def job_inputs(cfg, finetune: Optional[str] = None, checkpoint: Optional[str] = None) -> tuple[dict, dict]:
    """(role -> files, role -> folders) a training, tuning or evaluation job reads."""
    d = cfg.data
    teacher = cfg.distill.teacher
    if teacher and teacher.startswith("local-dir:"):
        teacher = teacher[len("local-dir:"):]
    files = {"data list": _existing(d.train_csv, d.val_csv), "classes file": _existing(d.classes),
             "teacher": [t for t in _existing(teacher) if os.path.isfile(t)],
             "model.weights file": _existing(cfg.model.weights), "--finetune checkpoint": _existing(finetune),
             "checkpoint": [c for c in _existing(checkpoint) if os.path.isfile(c)]}
    dirs = {"data root": [r for r in _existing(d.root and os.path.expanduser(d.root)) if os.path.isdir(r)],
            "data list's folder": _parent_dirs(d.train_csv, d.val_csv),
            "shards' folder": _shard_dirs(d.train_shards) + _shard_dirs(d.val_shards),
            "teacher folder": [t for t in _existing(teacher) if os.path.isdir(t)],
            "checkpoint folder": [c for c in _existing(checkpoint) if os.path.isdir(c)]}
    return files, dirs


def check_store_apart(cfg, finetune: Optional[str] = None, checkpoint: Optional[str] = None) -> None:
    """ConfigError (exit 2, before any work) when the local store that tracking would write (tracking.uri, else
    MLFLOW_TRACKING_URI) is or lies inside an input of the job, or a folder store holds one."""
    if cfg.tracking.backend != "none":
        check_store_apart_from(cfg.tracking, *job_inputs(cfg, finetune, checkpoint))


def check_store_apart_from(tracking, files: dict, dirs: dict) -> None:
    """check_store_apart for given inputs: role -> files, role -> folders (those that do not exist are left out)."""
    uri, key = ((tracking.uri, "'tracking.uri'") if tracking.uri else
                (os.environ.get("MLFLOW_TRACKING_URI"), "MLFLOW_TRACKING_URI"))
    folder, file = local_store(uri)
    if folder is None and file is None:
        return
    files = {role: [f for f in paths if f and os.path.isfile(f)] for role, paths in files.items()}
    dirs = {role: [d for d in paths if d and os.path.isdir(d)] for role, paths in dirs.items()}
    if folder is not None:
        check_outputs_apart({}, files, dirs, {f"{key} (a folder store)": folder})
    else:
        check_outputs_apart({f"{key} (a SQLite store)": file}, files, dirs)


def check_tracking_client(t: TrackingConfig) -> None:
    """A job that logs (train.py, tune.py, eval.py asked to) needs the client installed, and one that opens
    the store named: MLflow 3 refuses a folder store unless MLFLOW_ALLOW_FILE_STORE=true (else every record
    would go to the backlog). eval.py and infer.py of a tracked run's checkpoint need neither."""
    if t.backend != "mlflow":
        return
    if not tracking_client_installed():
        raise ConfigError("'tracking.backend' = mlflow needs the MLflow client: pip install \"imgcls[track]\" "
                          "(mlflow-skinny: a tracking server) or pip install mlflow (also the local SQLite store "
                          "and mlflow ui)")
    uri, key = (t.uri, "'tracking.uri'") if t.uri else (os.environ.get("MLFLOW_TRACKING_URI"), "MLFLOW_TRACKING_URI")
    if uri and is_folder_uri(uri) and not folder_store_allowed():
        raise ConfigError(f"{key} = {redact_uri(uri)!r} is a folder store, which the installed MLflow no longer "
                          f"opens (its file store is in maintenance mode); use a database, e.g. "
                          f"tracking.uri=sqlite:///mlflow.db (mlflow migrate-filestore converts an old folder), or "
                          f"set MLFLOW_ALLOW_FILE_STORE=true to keep the folder")


def is_folder_uri(uri: str) -> bool:
    """A tracking URI naming a folder store: a plain path, or file:."""
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", uri)
    return match is None or re.match(r"^[A-Za-z]:[\\/]", uri) is not None or match.group(1).lower() == "file"


def folder_store_allowed() -> bool:
    """Whether the installed MLflow opens a folder store (MLflow 3 only with MLFLOW_ALLOW_FILE_STORE=true)."""
    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    except ImportError:  # an MLflow from before the file store's maintenance mode
        return True
    return bool(MLFLOW_ALLOW_FILE_STORE.get())

BACKLOG_NAME = "tracking_backlog.jsonl"


class Backlog:
    """Appends records to the backlog file (both the sender thread and the caller may write: one lock)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock = threading.Lock()
        self.written = 0

    def append(self, records: list[dict]) -> None:
        if not records:
            return
        lines = "".join(json.dumps(r, allow_nan=False) + "\n" for r in map(finite_record, records))
        with self.lock:
            with self.path.open("a") as f:
                f.write(lines)
                f.flush()
            self.written += len(records)


def finite_record(record: dict) -> dict:
    """The record with non-finite metric values left out (MLflow takes them; JSON does not)."""
    if record.get("op") != "metrics":
        return record
    return {**record, "metrics": {k: v for k, v in record["metrics"].items() if math.isfinite(v)}}


def read_backlog(path: Path) -> list[dict]:
    """The records of a backlog file, in order; a line cut short by a kill (the last one) is left out."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "op" in record:
            records.append(record)
    return records


OPS = ("start", "params", "tags", "metrics", "artifact", "end")


END_STATUSES = ("FINISHED", "FAILED", "KILLED")


ID_PATTERN = re.compile(r"[0-9A-Za-z_-]{1,64}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _text_map(value, numbers: bool = False) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and (isinstance(v, str) or (numbers and _is_number(v))) for k, v in value.items())


def _op_problem(record: dict) -> Optional[str]:
    op = record["op"]
    if op == "start":
        if not isinstance(record.get("experiment"), str) or not record["experiment"].strip():
            return "'experiment' must be a name"
        if not isinstance(record.get("run_name"), (str, type(None))) or not _text_map(record.get("tags") or {}):
            return "'run_name' must be text or null and 'tags' a map of names to text"
    elif op in ("params", "tags") and not _text_map(record.get(op), numbers=True):
        return f"'{op}' must be a map of names to text"
    elif op == "metrics":
        if not all(isinstance(record.get(k), int) and not isinstance(record.get(k), bool) for k in ("step", "timestamp")):
            return "'step' and 'timestamp' must be whole numbers"
        if not isinstance(record.get("metrics"), dict) or not all(
                isinstance(k, str) and _is_number(v) for k, v in record["metrics"].items()):
            return "'metrics' must be a map of names to finite numbers"
    elif op == "artifact":
        folder = record.get("artifact_path")
        if not isinstance(record.get("path"), str) or not record["path"]:
            return "'path' must name a file"
        if folder is not None and (not isinstance(folder, str) or folder.startswith("/") or ".." in folder.split("/")):
            return "'artifact_path' must be a relative folder name without '..'"
    elif op == "end" and record.get("status") not in END_STATUSES:
        return f"'status' must be one of {', '.join(END_STATUSES)}"
    return None


def record_problem(record) -> Optional[str]:
    """What makes a backlog line unusable as a record (None: nothing)."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if record.get("op") not in OPS:
        return f"'op' = {record.get('op')!r}; allowed: {', '.join(OPS)}"
    for key in ("run_id", "run_key", "session"):
        value = record.get(key)
        if value is not None and not (isinstance(value, str) and ID_PATTERN.fullmatch(value)):
            return f"'{key}' = {value!r}: must be null or an id (letters, digits, '-', '_')"
    return _op_problem(record)


log = logging.getLogger(__name__)


QUEUE_SIZE = 10_000           # records waiting; beyond it the caller writes them to the backlog itself


ATTEMPTS = 3                  # tries per record before it goes to the backlog


RETRY_WAIT_S = 0.5            # before the second try; doubled for each next one


DOWN_FOR_S = 30.0             # after a record failed every try, the store is not tried again for this long


WARN_EVERY_S = 60.0


# at the end, the start record may take this long: creating a new SQLite store runs MLflow's schema migrations,
# a minute on a loaded machine, and a store left half-migrated cannot be opened again
START_CALL_S = 180.0


_STOP = object()


class RateLimitedWarning:
    """log.warning at most once per `every_s` seconds; the ones held back are counted in the next."""

    def __init__(self, every_s: float = WARN_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.every_s, self.clock = every_s, clock
        self.last: Optional[float] = None
        self.held = 0

    def warn(self, message: str) -> bool:
        now = self.clock()
        if self.last is not None and now - self.last < self.every_s:
            self.held += 1
            return False
        more = f" ({self.held} more such warning(s) held back)" if self.held else ""
        log.warning("tracking: %s%s", message, more)
        self.last, self.held = now, 0
        return True


class Sender:
    """`submit` never blocks. `store` has `apply(record)` and `run_id`; `close(timeout_s)` sends what is queued
    (what is still unsent after the timeout goes to the backlog) and ends the thread."""

    def __init__(self, store, backlog: Backlog, queue_size: int = QUEUE_SIZE, attempts: int = ATTEMPTS,
                 retry_wait_s: float = RETRY_WAIT_S, down_for_s: float = DOWN_FOR_S,
                 on_started: Optional[Callable[[str], None]] = None):
        """`on_started(run_id)`: called on the sender thread once the store created or opened the run."""
        self.store, self.backlog = store, backlog
        self.on_started = on_started
        # the run the start record names (--resume: last.pt's): the records written to the backlog while the
        # store cannot confirm it still name it, so that a replay puts them there
        self.run_id_named: Optional[str] = None
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.attempts, self.retry_wait_s, self.down_for_s = attempts, retry_wait_s, down_for_s
        self.warning = RateLimitedWarning()
        self.down_until = 0.0
        self.run_missing = False        # the start record failed: nothing is sent, all goes to the backlog
        self.closing = threading.Event()
        self.in_flight: Optional[dict] = None
        self.progress_at = time.monotonic()  # when the thread last finished a record
        self.started = threading.Event()  # the start record was handled (the run exists, or it failed)
        self.thread = threading.Thread(target=self._work, name="tracking-sender", daemon=True)
        self.thread.start()

    def submit(self, record: dict) -> None:
        if record.get("op") == "start":
            self.run_id_named = record.get("run_id")
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.backlog.append([self._addressed(record)])
            self.warning.warn(f"the tracking store is slower than the job: records go to {self.backlog.path}")

    def _addressed(self, record: dict) -> dict:
        return record if record.get("op") == "start" else {**record, "run_id": self.store.run_id or self.run_id_named}

    def _work(self) -> None:
        while True:
            record = self.queue.get()
            if record is _STOP:
                return
            self.in_flight = record
            self._send(record)
            self.in_flight = None
            self.progress_at = time.monotonic()
            if record.get("op") == "start":
                self._started()

    def _started(self) -> None:
        if self.store.run_id and self.on_started is not None:
            try:
                self.on_started(self.store.run_id)
            except OSError as err:  # a full disk: the run id is still in last.pt
                log.warning("tracking: could not record run %s in the run directory: %s", self.store.run_id, err)
        self.started.set()

    def _send(self, record: dict) -> None:
        if self.run_missing or time.monotonic() < self.down_until:
            self.backlog.append([self._addressed(record)])
            return
        error = None
        for attempt in range(self.attempts):
            try:
                self.store.apply(record)
                return
            except Exception as err:  # whatever the store raises: the job goes on
                error = err
                if attempt + 1 < self.attempts and self.closing.wait(self.retry_wait_s * 2 ** attempt):
                    break
        self.down_until = time.monotonic() + self.down_for_s
        if record.get("op") == "start" and self.store.run_id is None:
            self.run_missing = True
        self.backlog.append([self._addressed(record)])
        reason = redact_text((str(error).strip().splitlines() or [type(error).__name__])[0])[:300]
        self.warning.warn(f"could not reach the tracking store ({type(error).__name__}: {reason}); the run "
                          f"goes on, and what is not logged goes to {self.backlog.path} (send it later with "
                          f"python -m imgcls.tracking.replay {self.backlog.path.parent})")

    def close(self, timeout_s: float) -> None:
        """Send what is queued while the store keeps answering: the wait ends when no record was finished for
        `timeout_s` (START_CALL_S while the run is being created); the rest goes to the backlog."""
        try:
            self.queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            pass
        while self.thread.is_alive():
            limit = START_CALL_S if (self.in_flight or {}).get("op") == "start" else timeout_s
            if time.monotonic() - self.progress_at > limit:
                break
            self.thread.join(0.2)
        if self.thread.is_alive():  # the store hangs: what is left is written out, the daemon thread abandoned
            self.closing.set()
            left = [r for r in [self.in_flight, *drain(self.queue)] if r is not None and r is not _STOP]
            self.backlog.append([self._addressed(r) for r in left])
            log.warning("tracking: the store stopped answering at the end (nothing sent for %.0f s); %d "
                        "record(s) written to %s", timeout_s, len(left), self.backlog.path)


def drain(q: queue.Queue) -> list:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


# MLflow's HTTP client retries a failed request 7 times with exponential back-off and waits 120 s for an
# answer by default: minutes per call against a server that went away. The sender retries by itself.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


PARAMS_PER_CALL = 100     # MLflow's log_batch limits: 100 params, 1000 metrics, 100 tags a call


METRICS_PER_CALL = 1000


PARAM_VALUE_MAX = 6000    # MLflow's longest param value


TAG_VALUE_MAX = 8000


RUN_KEY_TAG = "imgcls.run_key"            # the client-side key of the run (tracking.runs)


PREVIOUS_RUN_TAG = "imgcls.previous_run_id"  # the run id last.pt named, which this store did not hold


RUN_KEY_PATTERN = re.compile(r"[0-9A-Za-z_-]{1,64}")


class RunNotFound(Exception):
    """The store answers, but holds no run of the id that eval.py's checkpoint names."""


def use_short_http_timeouts() -> None:
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    install_log_redaction()  # the client's own log lines name the URI, with the user's credentials


class MlflowStore:
    """One MLflow run, opened by a `start` record; `apply` sends one record (raises when the store fails).
    Metric points whose (name, step) the run already holds are not sent again: a resumed run re-runs the
    steps after its checkpoint, and a replay may repeat what a slow call did send."""

    def __init__(self, uri: Optional[str]):
        self.uri = uri
        self.client = None
        self.run_id: Optional[str] = None
        self.logged: dict[str, set[int]] = {}   # metric name -> steps the run holds
        self.params: set[str] = set()           # param names the run holds (a param cannot change)
        self.tags: dict[str, str] = {}          # the run's tags (one with its value already is not sent again)
        self.status: Optional[str] = None

    def _client(self):
        if self.client is None:
            from mlflow.tracking import MlflowClient

            use_short_http_timeouts()
            self.client = MlflowClient(tracking_uri=self.uri)
        return self.client

    def apply(self, record: dict) -> None:
        getattr(self, "_" + record["op"])(record)

    def attach(self, run_id: str, run=None) -> None:
        """Log into the existing run `run_id` from now on (what it holds is read, so nothing is sent twice)."""
        client = self._client()
        run = run or client.get_run(run_id)
        self.run_id = run.info.run_id
        self.status = run.info.status
        self.params = set(run.data.params)
        self.tags = dict(run.data.tags)
        self.logged = {key: {m.step for m in client.get_metric_history(self.run_id, key)}
                       for key in run.data.metrics}

    def _start(self, record: dict) -> None:
        """The run a `start` record names (--resume: the run last.pt names goes on), else the run created
        earlier for its `run_key` (by a job whose start this store missed, or by a replay), else a new one.
        A named run this store does not hold (tracking.uri changed on resume) is replaced by a new run tagged
        with the old id; eval.py's records (`attach_only`) go into the named run or nowhere."""
        client = self._client()
        wanted = record.get("run_id")
        run = self._get_run(wanted) if wanted else None
        if run is None and record.get("attach_only"):
            raise RunNotFound(f"the store holds no run {wanted}")
        if run is None and record.get("run_key"):
            run = self._find_by_key(record["experiment"], record["run_key"])
        if run is not None:
            self.attach(run.info.run_id, run)
            if record.get("reopen") and not record.get("replayed"):
                client.update_run(self.run_id, status="RUNNING")
                self.status = "RUNNING"
            if record.get("tags"):
                self._tags({"tags": record["tags"]})
            return
        tags = dict(record.get("tags") or {})
        if record.get("run_key"):
            tags[RUN_KEY_TAG] = record["run_key"]
        if wanted:
            tags[PREVIOUS_RUN_TAG] = wanted
        run = client.create_run(self._experiment_id(record["experiment"]), run_name=record.get("run_name"),
                                tags={k: clip(str(v), TAG_VALUE_MAX) for k, v in tags.items()})
        self.run_id, self.status = run.info.run_id, run.info.status
        self.params, self.logged, self.tags = set(), {}, tags

    def _get_run(self, run_id: str):
        """The run, or None when the store answers that it holds no such run (raises when it fails)."""
        from mlflow.exceptions import MlflowException

        try:
            return self._client().get_run(run_id)
        except MlflowException as err:
            if err.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise

    def _find_by_key(self, experiment: str, run_key: str):
        """The experiment's run tagged with `run_key` (None: none yet)."""
        client = self._client()
        found = client.get_experiment_by_name(experiment)
        if found is None or found.lifecycle_stage == "deleted" or not RUN_KEY_PATTERN.fullmatch(run_key):
            return None
        runs = client.search_runs([found.experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'",
                                  max_results=1)
        return runs[0] if runs else None

    def _experiment_id(self, name: str) -> str:
        client = self._client()
        found = client.get_experiment_by_name(name)
        if found is None:
            try:
                return client.create_experiment(name)
            except Exception:  # created meanwhile by another job
                found = client.get_experiment_by_name(name)
                if found is None:
                    raise
        if found.lifecycle_stage == "deleted":
            client.restore_experiment(found.experiment_id)
        return found.experiment_id

    def _params(self, record: dict) -> None:
        from mlflow.entities import Param

        new = [(k, v) for k, v in record["params"].items() if k not in self.params]
        for i in range(0, len(new), PARAMS_PER_CALL):
            chunk = new[i:i + PARAMS_PER_CALL]
            self._client().log_batch(self.run_id, params=[Param(k, clip(str(v), PARAM_VALUE_MAX)) for k, v in chunk])
            self.params.update(k for k, _ in chunk)

    def _tags(self, record: dict) -> None:
        from mlflow.entities import RunTag

        new = {k: clip(str(v), TAG_VALUE_MAX) for k, v in record["tags"].items()}
        new = {k: v for k, v in new.items() if self.tags.get(k) != v}
        if new:
            self._client().log_batch(self.run_id, tags=[RunTag(k, v) for k, v in new.items()])
            self.tags.update(new)

    def _metrics(self, record: dict) -> None:
        from mlflow.entities import Metric

        step = int(record["step"])
        new = {k: float(v) for k, v in record["metrics"].items() if step not in self.logged.get(k, ())}
        if not new:
            return
        metrics = [Metric(k, v, int(record["timestamp"]), step) for k, v in new.items()]
        for i in range(0, len(metrics), METRICS_PER_CALL):
            self._client().log_batch(self.run_id, metrics=metrics[i:i + METRICS_PER_CALL])
        for key in new:
            self.logged.setdefault(key, set()).add(step)

    def _artifact(self, record: dict) -> None:
        path = Path(record["path"])
        if not path.is_file():  # a file gone since is not the store's failure (replay counts it beforehand)
            return
        if record.get("replayed") and self._holds_artifact(path, record.get("artifact_path")):
            return  # sent by the job or an earlier replay
        self._client().log_artifact(self.run_id, str(path), record.get("artifact_path"))

    def _holds_artifact(self, path: Path, artifact_path: Optional[str]) -> bool:
        name = f"{artifact_path}/{path.name}" if artifact_path else path.name
        held = self._client().list_artifacts(self.run_id, artifact_path)
        return any(f.path == name and f.file_size == path.stat().st_size for f in held)

    def _end(self, record: dict) -> None:
        if record.get("replayed") and self.status == record["status"]:
            return
        self._client().set_terminated(self.run_id, record["status"])
        self.status = record["status"]


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
        client-side key (tracking.runs), which finds the run again when `run_id` is unknown; `reopen`
        (default: given a run id): a resumed job's run goes back to RUNNING. `on_started(run_id)` is called
        once the store created or opened the run; `attempts`: tries per record."""

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
