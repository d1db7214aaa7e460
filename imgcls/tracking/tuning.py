"""tune.py's tracking: a run of its own per sweep or LR range test, with the config as parameters, the table
as metrics (a sweep's rows at step = effective batch; the LR range test's loss at each step) and its JSON
and plot as artifacts."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from imgcls.tracking.run_tags import config_params, flat_numbers, job_tags
from imgcls.tracking.tracker import open_tracker


def log_tune_run(cfg, kind: str, doc: dict, files: list[Optional[str]], world_size: int, device: str) -> None:
    """`kind`: sweep | lr_range. The backlog, if the store is away, goes beside the JSON (else here)."""
    if cfg.tracking.backend == "none":
        return
    json_path = next((f for f in files if f and f.endswith(".json")), None)
    backlog_dir = Path(json_path).resolve().parent if json_path else Path.cwd()
    run_name = f"tune-{kind}-{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    tracker = open_tracker(cfg.tracking, backlog_dir, cfg.source_name or "imgcls", run_name,
                           tags={**job_tags(world_size, device), "imgcls.tune": kind})
    tracker.log_params(config_params(cfg.to_dict()))
    if kind == "sweep":
        for row in doc["rows"]:
            tracker.log_metrics(flat_numbers(row, "sweep/"), int(row["effective_batch"]))
        tracker.log_metrics(flat_numbers({"steps": doc["steps"], "target_loss": doc["target_loss"]}, "sweep/"), 0)
    else:
        for step, (lr, loss) in enumerate(zip(doc["lrs"], doc["smoothed_loss"])):
            tracker.log_metrics({"lr_range/lr": lr, "lr_range/smoothed_loss": loss}, step)
        tracker.log_metrics(flat_numbers({k: v for k, v in doc.items() if not isinstance(v, list)}, "lr_range/"), 0)
    for file in files:
        if file and Path(file).is_file():
            tracker.log_artifact(file)
    tracker.close()
