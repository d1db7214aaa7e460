"""Experiment tracking: a run's parameters, tags, curves and files also go to a tracking backend (MLflow).

The trainer, eval.py and tune.py report through `tracking.tracker.Tracker`; `open_tracker` builds the one the
config asks for (`tracking.backend`). Nothing here may block or fail the job it records: calls are queued and
sent by a background thread, and what cannot be sent goes to `tracking_backlog.jsonl` in the run directory,
which `python -m imgcls.tracking.replay RUN_DIR` sends later.
"""
