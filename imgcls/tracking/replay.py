"""Send a run directory's tracking backlog (what could not be logged while the job ran) to the tracking store.

python -m imgcls.tracking.replay RUN_DIR [--uri URI]

The store is --uri, else the run's config.yaml `tracking.uri`, else MLflow's own resolution. Every line is
checked first: a line that is not a record stops the replay before anything is sent (exit 2, naming the
line). Records go to their run by the run's key (the same across a run's resumed jobs): the run the records
name, else the run created earlier for that key (found again by its `imgcls.run_key` tag, or by the run id in
tracking_run.json), else a new run made from the key's start record. What the run already holds (metric
points, params, tags, files of the same size, its end status) is not sent again, so a replay can be repeated.
Only files inside RUN_DIR are uploaded.

When everything is sent, the file is renamed tracking_backlog.replayed-<time>.jsonl. Exit status: 0 all
sent; 1 the store failed or refused a record (the backlog is kept: run this again), or some records could not
be sent (files outside RUN_DIR or gone, no run to put them in: listed, and kept in tracking_backlog.jsonl);
2 usage error (no backlog, a malformed line, a bad URI).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import yaml

from imgcls.core.errors import redact_text, redact_uri
from imgcls.tracking.runs import note_run_id, read_run_record
from imgcls.tracking.settings import tracking_uri_problem
from imgcls.tracking.tracker import BACKLOG_NAME, record_problem

# error codes with which a store that answered turns a record down (anything else: it failed or was away)
REFUSALS = ("INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST", "BAD_REQUEST",
            "INVALID_STATE", "PERMISSION_DENIED", "UNAUTHENTICATED", "RESOURCE_LIMIT_EXCEEDED")


class BadBacklog(Exception):
    """A line that is not a record: nothing is sent."""


class ReplayStopped(Exception):
    """The store failed or refused the record at `line`; what came before it was sent."""

    def __init__(self, line: int, record: dict, error: Exception):
        super().__init__(str(error))
        self.line, self.record, self.error = line, record, error


def recorded_uri(run_dir: Path) -> Optional[str]:
    """tracking.uri of the run's config.yaml (None when unset or unreadable)."""
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    tracking = config.get("tracking") if isinstance(config, dict) else None
    return tracking.get("uri") if isinstance(tracking, dict) else None


def read_records(path: Path) -> tuple[list[tuple[int, dict]], int]:
    """(line number, record) of every line, and how many lines a kill cut short (the unfinished last line).
    BadBacklog names the first line that is not a record."""
    lines = Path(path).read_text(errors="replace").split("\n")
    records, cut = [], 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):  # no newline after it: the write was cut short
                cut += 1
                continue
            raise BadBacklog(f"line {number} is not JSON ({err.msg})") from None
        problem = record_problem(record)
        if problem:
            raise BadBacklog(f"line {number}: {problem}")
        records.append((number, record))
    return records, cut


def run_groups(records: list[tuple[int, dict]]) -> dict[str, list[tuple[int, dict]]]:
    """The records of each run, in order, by run key. A backlog written before keys: a job's records go with
    its start record's run (their run id was left null when that start failed), else by their run id."""
    session_run = {r.get("session"): r.get("run_id") for _, r in records
                   if r["op"] == "start" and not r.get("run_key") and r.get("run_id")}
    groups: dict[str, list[tuple[int, dict]]] = {}
    for number, record in records:
        key = (record.get("run_key") or record.get("run_id") or session_run.get(record.get("session"))
               or f"session:{record.get('session')}")
        groups.setdefault(key, []).append((number, record))
    return groups


def artifact_problem(record: dict, run_dir: Path) -> Optional[str]:
    """Why an artifact record's file is not uploaded (None: it is): only regular files inside the run
    directory go out, whatever a backlog names."""
    path = os.path.realpath(record["path"])
    inside = os.path.realpath(run_dir)
    if not path.startswith(inside.rstrip(os.sep) + os.sep):
        return f"{record['path']} lies outside {run_dir}; only files of the run directory are uploaded"
    if not os.path.isfile(path):
        return f"{record['path']} is gone (or not a regular file)"
    return None


def open_group_run(store, items: list[tuple[int, dict]], recorded: dict) -> Optional[str]:
    """Open the run of one key's records in `store`; None when there is none to put them in (the reason)."""
    from imgcls.tracking.tracker import RunNotFound

    starts = [(n, r) for n, r in items if r["op"] == "start"]
    named = next((r["run_id"] for _, r in items if r.get("run_id")), None)
    if not starts:
        if named is None:
            return "no start record and no run id (the job that wrote them was stopped before it could say)"
        starts = [(items[0][0], {"op": "start", "run_id": named, "attach_only": True, "experiment": "-"})]
    number, first = next(((n, r) for n, r in starts if r.get("run_id")), starts[0])
    key = first.get("run_key")
    start = {**first, "run_id": first.get("run_id") or named or (recorded.get("run_id") if key and key ==
                                                                  recorded.get("run_key") else None)}
    try:
        store.apply({**start, "replayed": True})
    except RunNotFound:
        return f"the store holds no run {start['run_id']} to add them to"
    except Exception as err:
        raise ReplayStopped(number, first, err) from err
    for n, r in starts:
        if r is not first and r.get("tags"):
            send(store, n, {"op": "tags", "tags": r["tags"]})
    return None


def send(store, number: int, record: dict) -> None:
    try:
        store.apply({**record, "replayed": True})
    except Exception as err:
        raise ReplayStopped(number, record, err) from err


def replay(records: list[tuple[int, dict]], uri: Optional[str], run_dir: Path) -> tuple[dict, list]:
    """Send `records`; returns ({run id: records sent}, [(line, reason) of the records left out]). Raises
    ReplayStopped when the store fails or refuses one."""
    from imgcls.tracking.tracker import MlflowStore

    sent: dict[str, int] = {}
    left_out: list[tuple[int, str]] = []
    recorded = read_run_record(run_dir)
    for key, items in run_groups(records).items():
        store = MlflowStore(uri)
        reason = open_group_run(store, items, recorded)
        if reason:
            left_out += [(n, reason) for n, r in items if r["op"] != "start"]
            continue
        note_run_id(run_dir, key, store.run_id)  # a second replay finds the run it created
        last_end = max((n for n, r in items if r["op"] == "end"), default=None)
        sent[store.run_id] = sent.get(store.run_id, 0) + sum(r["op"] == "start" for _, r in items)
        for number, record in items:
            if record["op"] == "start" or (record["op"] == "end" and number != last_end):
                continue  # opened above; an end that a later job's start reopened
            problem = artifact_problem(record, run_dir) if record["op"] == "artifact" else None
            if problem:
                left_out.append((number, problem))
                continue
            send(store, number, record)
            sent[store.run_id] += 1
    return sent, left_out


def replayed_name(path: Path) -> Path:
    """tracking_backlog.replayed-<time>.jsonl, not yet taken (a second replay within the same second)."""
    stem = f"tracking_backlog.replayed-{time.strftime('%Y%m%dT%H%M%S')}"
    done, n = path.with_name(stem + ".jsonl"), 1
    while done.exists():
        n += 1
        done = path.with_name(f"{stem}-{n}.jsonl")
    return done


def lines_to_keep(records: list[tuple[int, dict]], left_out: list[tuple[int, str]]) -> set[int]:
    """The lines left out, with the start records of their runs (which find the run again next time)."""
    numbers = {n for n, _ in left_out}
    keys = {key for key, items in run_groups(records).items() if any(n in numbers for n, _ in items)}
    return numbers | {n for key in keys for n, r in run_groups(records)[key] if r["op"] == "start"}


def keep_left_out(path: Path, numbers: set[int]) -> Path:
    """Move the sent lines to tracking_backlog.replayed-<time>.jsonl and keep only the `numbers` lines (those
    left out) in the backlog, each file written whole before it replaces anything."""
    lines = path.read_text(errors="replace").split("\n")
    done = replayed_name(path)
    kept = "".join(line + "\n" for n, line in enumerate(lines, 1) if n in numbers)
    sent = "".join(line + "\n" for n, line in enumerate(lines, 1) if line.strip() and n not in numbers)
    for target, text in ((done, sent), (path, kept)):
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, target)
    return done


def stopped_message(err: ReplayStopped, path: Path) -> str:
    from imgcls.tracking.tracker import RunNotFound

    code = getattr(err.error, "error_code", None)
    what = f"line {err.line} ({err.record['op']})"
    detail = redact_text(f"{type(err.error).__name__}: {str(err.error).strip()[:300]}")
    if code in REFUSALS or isinstance(err.error, RunNotFound):
        return (f"error: the tracking store refused the record at {what}: {detail}; the records before it were "
                f"sent; fix or delete that line of {path} and run this again (what was sent is not sent twice)")
    return (f"error: the tracking store failed at {what} ({detail}); {path} is kept, run this again when the "
            f"store answers (what was sent is not sent twice)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m imgcls.tracking.replay", description=__doc__,
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
        print(f"error: tracking URI {redact_uri(uri)!r}{'' if args.uri else ' (the run config.yaml)'}: {problem}",
              file=sys.stderr)
        return 2
    try:
        records, cut = read_records(path)
    except BadBacklog as err:
        print(f"error: {path}: {err}; nothing was sent. Fix or delete that line and run this again",
              file=sys.stderr)
        return 2
    try:
        sent, left_out = replay(records, uri, run_dir)
    except ReplayStopped as err:
        print(stopped_message(err, path), file=sys.stderr)
        return 1
    for run_id, count in sent.items():
        print(f"run {run_id}: {count} record(s) sent")
    if cut:
        print(f"note: left out the last line of {path}: cut short when the job was killed (never a whole record)",
              file=sys.stderr)
    if left_out:
        done = keep_left_out(path, lines_to_keep(records, left_out))
        print(f"error: {len(left_out)} of {len(records)} record(s) were not sent and stay in {path} (the "
              f"{len(records) - len(left_out)} sent are in {done.name}):", file=sys.stderr)
        for number, reason in left_out[:20]:
            print(f"  line {number}: {reason}", file=sys.stderr)
        if len(left_out) > 20:
            print(f"  ... and {len(left_out) - 20} more", file=sys.stderr)
        return 1
    done = replayed_name(path)
    path.rename(done)
    print(f"replayed {len(records)} record(s) from {path}; the file is now {done.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
