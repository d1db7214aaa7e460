"""eval.py's tracking: the figures of `eval.py --checkpoint best.pt` go into the training run that wrote the
checkpoint (its `tracking_run_id`), as `eval/<name>` at the checkpoint's step, with the report files as
artifacts under eval/. The run's status stays as it is."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from tracking.run_tags import flat_numbers
from tracking.tracker import open_tracker
from tracking.training import RUN_ID_KEY

log = logging.getLogger(__name__)


def checkpoint_tracking(path: Path, overrides: list[str]):
    """(tracking config, run id, step) of a train.py checkpoint, its tracking.* overridden by `overrides`;
    None for a model file without a run (an export, a checkpoint of an untracked run)."""
    import torch

    from core.config import Config, apply_dict, apply_overrides
    from tracking.settings import check_tracking

    if not (path.is_file() and path.suffix == ".pt"):
        return None
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    run_id = ckpt.get(RUN_ID_KEY) if isinstance(ckpt, dict) else None
    if not run_id:
        return None
    cfg = Config()
    apply_dict(cfg, {"tracking": (ckpt.get("config") or {}).get("tracking") or {}}, source="checkpoint")
    apply_overrides(cfg, [o for o in overrides if o.split("=", 1)[0].startswith("tracking.")])
    check_tracking(cfg.tracking)
    return cfg.tracking, run_id, int(ckpt.get("step") or 0)


def log_evaluation(checkpoint: str, overrides: list[str], figures: dict, files: list[Optional[str]]) -> None:
    """Add `figures` (nested numbers are flattened: eval/selective/coverage) and `files` to the checkpoint's run."""
    found = checkpoint_tracking(Path(checkpoint), overrides)
    if found is None or found[0].backend == "none":
        return
    tracking_cfg, run_id, step = found
    from tracking.settings import tracking_client_installed

    if not tracking_client_installed():
        log.warning("tracking: %s names tracking run %s, but MLflow is not installed here (pip install "
                    "mlflow-skinny); the figures are not logged", checkpoint, run_id)
        return
    tracker = open_tracker(tracking_cfg, Path(checkpoint).parent, "imgcls", None, run_id, attach_only=True)
    tracker.log_metrics(flat_numbers(figures, "eval/"), step)
    for file in files:
        if file and Path(file).is_file():
            tracker.log_artifact(file, "eval")
    tracker.close()
    log.info("tracking: eval/ figures added to run %s", run_id)
