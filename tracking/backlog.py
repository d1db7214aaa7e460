"""The backlog: records that could not be sent, one JSON object a line in `<run dir>/tracking_backlog.jsonl`.

A record is a plain dict with an `op`: `start` (open or create the run), `params`, `tags`, `metrics` (`step`,
`timestamp` in ms, `metrics`: name -> value), `artifact` (`path`, `artifact_path`) or `end` (`status`). Each
carries `run_id`: the run it belongs to, or null when the run had not been created yet (then it belongs to
the run that its job's `start` record creates on replay), and `session`: the job (one tracker) it came from.
"""
from __future__ import annotations

import json
import math
import threading
from pathlib import Path

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
