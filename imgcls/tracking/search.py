"""tune.py --search's tracking: one run for the study (the trials' values and results as metrics at step = the
trial's number, trials.csv, best.yaml and the plots as artifacts), and each trial's own training run nested
under it: the trial's train.py gets the study's run id in PARENT_RUN_ENV and tags its run with it."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from imgcls.tracking.run_tags import PARENT_RUN_ENV
from imgcls.tracking.tracker import open_tracker

log = logging.getLogger(__name__)

RUN_START_TIMEOUT_S = 60.0  # the store creates the run in the background; trials wait this long to nest under it


class StudyTracking:
    def __init__(self, tracking_cfg, study_dir: Path, experiment: str, run_id: Optional[str]):
        self.tracker = open_tracker(tracking_cfg, study_dir, experiment, f"search-{study_dir.resolve().name}",
                                    run_id, tags={"imgcls.search": str(study_dir)})
        self.run_id = self.tracker.wait_for_run(RUN_START_TIMEOUT_S) if tracking_cfg.backend != "none" else None
        if tracking_cfg.backend != "none" and self.run_id is None:
            log.warning("search: the tracking store did not open the study's run within %.0f s: the trials' runs "
                        "are not nested under it", RUN_START_TIMEOUT_S)

    def trial_environment(self) -> dict:
        return {PARENT_RUN_ENV: self.run_id} if self.run_id else {}

    def log_trial(self, number: int, values: dict, state: str, value: Optional[float]) -> None:
        numbers = {f"search/{k}": v for k, v in values.items() if isinstance(v, (int, float))}
        self.tracker.log_metrics({**numbers, "search/value": value, "search/complete": float(state == "COMPLETE"),
                                  "search/pruned": float(state == "PRUNED")}, number)

    def close(self, files: list[Path], finished: bool) -> None:
        for path in files:
            if path.is_file():
                self.tracker.log_artifact(path)
        self.tracker.close("FINISHED" if finished else "KILLED")
