"""The backlog: records that could not be sent, one JSON object a line in `<run dir>/tracking_backlog.jsonl`.

A record is a plain dict with an `op`: `start` (open or create the run), `params`, `tags`, `metrics` (`step`,
`timestamp` in ms, `metrics`: name -> value), `artifact` (`path`, `artifact_path`) or `end` (`status`). Each
carries `run_key`: the run it belongs to, as the client knows it (tracking.run_record; the same across the
jobs of a resumed run), `run_id`: the store's id of that run when known, or null when the run had not been
created yet (then it belongs to the run that its `start` record creates or finds on replay), and `session`:
the job (one tracker) it came from.
"""
from __future__ import annotations

import json
import math
import re
import threading
from pathlib import Path
from typing import Optional

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
