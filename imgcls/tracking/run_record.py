"""`<run dir>/tracking_run.json`: the run's client-side key and, once a store created or found it, the run id.

The key is made when a run starts tracking and kept across --resume, so every record of every job of the run
can be put into one tracking run, even when the store was down the whole time: the run is created with the
tag `imgcls.run_key` (tracking.mlflow_store), and a later job or replay finds it again by that tag or by the
run id written here. Written atomically (a reader never sees half a file)."""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Optional

from imgcls.core.outputs import write_json

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
