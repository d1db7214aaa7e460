"""eval.py's tracking: the figures of `eval.py --checkpoint best.pt ... tracking.backend=mlflow` go into the
training run that wrote the checkpoint (its `tracking_run_id`), as `eval/<name>` at the checkpoint's step,
with the report files as artifacts under eval/. The run's status stays as it is.

Only when the user asks on eval.py's command line: the store is their `tracking.uri` (else MLflow's own
resolution, MLFLOW_TRACKING_URI), never the one a checkpoint's config names: a file someone gives you must
not make eval.py send its results (and the data's paths) anywhere."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from imgcls.tracking.run_tags import flat_numbers
from imgcls.tracking.store_location import check_store_apart_from
from imgcls.tracking.tracker import open_tracker
from imgcls.tracking.training import RUN_ID_KEY

log = logging.getLogger(__name__)


def asked_tracking(overrides: list[str]):
    """The tracking.* of eval.py's command line (defaults for the rest, none from the checkpoint); None unless
    they turn tracking on. ConfigError (exit 2) for a bad value."""
    from imgcls.core.config import Config, apply_overrides, check_tracking

    cfg = Config()
    apply_overrides(cfg, [o for o in overrides if o.split("=", 1)[0].strip().startswith("tracking.")])
    check_tracking(cfg.tracking)
    return cfg.tracking if cfg.tracking.backend != "none" else None


def check_eval_tracking(overrides: list[str], checkpoint: str, data: Optional[str]) -> None:
    """Before any work (exit 2): the client is installed and can open the store asked for, which lies apart
    from the checkpoint and the data."""
    from imgcls.tracking.store_location import check_tracking_client

    tracking = asked_tracking(overrides)
    if tracking is None:
        return
    check_tracking_client(tracking)
    check_store_apart_from(tracking, {"checkpoint": [checkpoint], "data list": [data] if data else []},
                           {"checkpoint folder": [checkpoint], "data root": [data] if data else []})


def checkpoint_run(path: Path) -> Optional[tuple[str, int]]:
    """(tracking run id, step) of a train.py checkpoint; None for a model file without a run (an export, a
    checkpoint of an untracked run)."""
    import torch

    if not (path.is_file() and path.suffix == ".pt"):
        return None
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    run_id = ckpt.get(RUN_ID_KEY) if isinstance(ckpt, dict) else None
    if not isinstance(run_id, str) or not run_id:
        return None
    step = ckpt.get("step")
    return run_id, step if isinstance(step, int) and not isinstance(step, bool) else 0


def log_evaluation(checkpoint: str, overrides: list[str], figures: dict, files: list[Optional[str]]) -> None:
    """Add `figures` (nested numbers are flattened: eval/selective/coverage) and `files` to the checkpoint's run,
    when eval.py's command line turns tracking on."""
    tracking = asked_tracking(overrides)
    found = checkpoint_run(Path(checkpoint))
    if found is None:
        if tracking is not None:
            log.warning("tracking: %s names no tracking run (an export, or a run trained without tracking); the "
                        "figures are not logged", checkpoint)
        return
    run_id, step = found
    if tracking is None:
        log.info("tracking: %s belongs to tracking run %s; to add these figures to it, pass tracking.backend=mlflow "
                 "(and tracking.uri=STORE, the store it was trained with)", checkpoint, run_id)
        return
    # one try per record: a store that does not answer costs one request timeout, not three
    tracker = open_tracker(tracking, Path(checkpoint).parent, "imgcls", None, run_id, attach_only=True, attempts=1)
    tracker.log_metrics(flat_numbers(figures, "eval/"), step)
    for file in files:
        if file and Path(file).is_file():
            tracker.log_artifact(file, "eval")
    tracker.close()
    if tracker.all_sent:
        log.info("tracking: eval/ figures added to run %s", run_id)
    else:
        backlog = tracker.sender.backlog.path
        log.warning("tracking: the eval/ figures did not reach run %s; they are in %s (send them with python -m "
                    "tracking.replay %s --uri STORE; only files inside that folder are uploaded)", run_id, backlog,
                    backlog.parent)
