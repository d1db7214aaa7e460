"""Records (tracking.backlog) applied to an MLflow tracking store through `MlflowClient`: the one place that
calls MLflow. Used by the sender thread during a job and by `python -m imgcls.tracking.replay` after it."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from imgcls.core.redaction import install_log_redaction

# MLflow's HTTP client retries a failed request 7 times with exponential back-off and waits 120 s for an
# answer by default: minutes per call against a server that went away. The sender retries by itself.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
PARAMS_PER_CALL = 100     # MLflow's log_batch limits: 100 params, 1000 metrics, 100 tags a call
METRICS_PER_CALL = 1000
PARAM_VALUE_MAX = 6000    # MLflow's longest param value
TAG_VALUE_MAX = 8000
RUN_KEY_TAG = "imgcls.run_key"            # the client-side key of the run (tracking.run_record)
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
