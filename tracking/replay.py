"""Send a run directory's tracking backlog (what could not be logged while the job ran) to the tracking store.

python -m tracking.replay RUN_DIR [--uri URI]

The store is --uri, else the run's config.yaml `tracking.uri`, else MLflow's own resolution. Records of a
run that was created go into that run; those of a run the store never created go into a new run, created now
from the backlog's start record. Points the run already holds are not sent twice, so a replay that stopped
half-way can be repeated. When everything is sent, the file is renamed tracking_backlog.replayed-<time>.jsonl.
Exit status: 0 sent, 1 the store failed (the backlog is kept), 2 usage error (no backlog, bad URI).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

import yaml

from tracking.settings import tracking_uri_problem
from tracking.backlog import BACKLOG_NAME, read_backlog


def recorded_uri(run_dir: Path) -> Optional[str]:
    """tracking.uri of the run's config.yaml (None when unset or unreadable)."""
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    tracking = config.get("tracking") if isinstance(config, dict) else None
    return tracking.get("uri") if isinstance(tracking, dict) else None


def replay(records: list[dict], uri: Optional[str]) -> dict:
    """Apply `records` in order; returns {run id: records sent}. Raises what the store raises."""
    from tracking.mlflow_store import MlflowStore

    stores: dict[str, MlflowStore] = {}
    created: dict[str, MlflowStore] = {}  # session -> the run made now from its start record (it had no run id)
    for record in records:
        if record["op"] == "start" and not record.get("run_id"):
            store = MlflowStore(uri)
            store.apply({**record, "replayed": True})
            created[record.get("session")] = stores[store.run_id] = store
    sent: dict[str, int] = {}
    for record in records:
        run_id = record.get("run_id")
        if run_id:
            if run_id not in stores:
                stores[run_id] = MlflowStore(uri)
                stores[run_id].attach(run_id)
            store = stores[run_id]
        else:
            store = created.get(record.get("session"))
            if store is None or record["op"] == "start":
                continue  # created above; or no run to put it in (its start record was lost with a killed job)
        store.apply({**record, "replayed": True})
        sent[store.run_id] = sent.get(store.run_id, 0) + 1
    return sent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tracking.replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="the run directory (output.dir) holding " + BACKLOG_NAME)
    parser.add_argument("--uri", help="the tracking store (default: the run's tracking.uri)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    path = run_dir / BACKLOG_NAME
    if not path.is_file():
        print(f"error: {path} does not exist: nothing to replay (a run writes it only when something could not "
              f"be logged)", file=sys.stderr)
        return 2
    uri = args.uri or recorded_uri(run_dir)
    problem = tracking_uri_problem(uri) if uri else None
    if problem:
        print(f"error: tracking URI {uri!r}: {problem}", file=sys.stderr)
        return 2
    records = read_backlog(path)
    try:
        sent = replay(records, uri)
    except Exception as err:  # the store's failure: keep the backlog for another try
        print(f"error: the tracking store failed ({type(err).__name__}: {str(err)[:300]}); {path} is kept, "
              f"run this again when the store answers", file=sys.stderr)
        return 1
    done = path.with_name(f"tracking_backlog.replayed-{time.strftime('%Y%m%dT%H%M%S')}.jsonl")
    path.rename(done)
    for run_id, count in sent.items():
        print(f"run {run_id}: {count} record(s) sent")
    print(f"replayed {len(records)} record(s) from {path}; the file is now {done.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
