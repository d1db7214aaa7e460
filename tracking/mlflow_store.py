"""Records (tracking.backlog) applied to an MLflow tracking store through `MlflowClient`: the one place that
calls MLflow. Used by the sender thread during a job and by `python -m tracking.replay` after it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

# MLflow's HTTP client retries a failed request 7 times with exponential back-off and waits 120 s for an
# answer by default: minutes per call against a server that went away. The sender retries by itself.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
PARAMS_PER_CALL = 100     # MLflow's log_batch limits: 100 params, 1000 metrics, 100 tags a call
METRICS_PER_CALL = 1000
PARAM_VALUE_MAX = 6000    # MLflow's longest param value
TAG_VALUE_MAX = 8000


def use_short_http_timeouts() -> None:
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)


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

    def _client(self):
        if self.client is None:
            from mlflow.tracking import MlflowClient

            use_short_http_timeouts()
            self.client = MlflowClient(tracking_uri=self.uri)
        return self.client

    def apply(self, record: dict) -> None:
        getattr(self, "_" + record["op"])(record)

    def attach(self, run_id: str) -> None:
        """Log into the existing run `run_id` from now on (what it holds is read, so nothing is sent twice)."""
        client = self._client()
        run = client.get_run(run_id)
        self.run_id = run.info.run_id
        self.params = set(run.data.params)
        self.logged = {key: {m.step for m in client.get_metric_history(self.run_id, key)}
                       for key in run.data.metrics}

    def _start(self, record: dict) -> None:
        client = self._client()
        if record.get("run_id"):  # --resume: the run last.pt names goes on
            self.attach(record["run_id"])
            if record.get("reopen") and not record.get("replayed"):
                client.update_run(self.run_id, status="RUNNING")
            if record.get("tags"):
                self._tags({"tags": record["tags"]})
            return
        experiment_id = self._experiment_id(record["experiment"])
        run = client.create_run(experiment_id, run_name=record.get("run_name"),
                                tags={k: clip(v, TAG_VALUE_MAX) for k, v in (record.get("tags") or {}).items()})
        self.run_id = run.info.run_id
        self.params, self.logged = set(), {}

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

        self._client().log_batch(self.run_id, tags=[RunTag(k, clip(str(v), TAG_VALUE_MAX))
                                                    for k, v in record["tags"].items()])

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
        if path.is_file():  # a file gone since (a replay long after) is not the store's failure
            self._client().log_artifact(self.run_id, str(path), record.get("artifact_path"))

    def _end(self, record: dict) -> None:
        self._client().set_terminated(self.run_id, record["status"])


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."
