"""The trust options of infer.py and serve.py: the reject option (`--reject`, `--reject-below X`) and Grad-CAM explanations
(`--explain DIR`), kept apart from the prediction pass; the scoring itself is engine.evaluation's.

Rows gain `predicted` (the would-be label, also for kept images), `score` (the reject score) and, with
--explain, `explain` (JSON) / `explain_peak` and `explain_overlay` (CSV); a rejected image's `label` is
`unknown`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from core.errors import ConfigError
from engine.evaluation.rejection import FeatureTap, LOGITS_METHOD, Rejector
from engine.evaluation.trust import usable_rejector
from tasks.single_label_rows import EXPLAIN_COLUMNS

log = logging.getLogger(__name__)

UNKNOWN = "unknown"
REJECT_COLUMNS = ["predicted", "score"]
EXPLAIN_BATCH = 16


@dataclass
class TrustOptions:
    reject: bool = False
    reject_below: Optional[float] = None
    explain_dir: Optional[str] = None

    @property
    def rejecting(self) -> bool:
        return self.reject or self.reject_below is not None


def extra_columns(options: TrustOptions) -> list[str]:
    return (REJECT_COLUMNS if options.rejecting else []) + (EXPLAIN_COLUMNS if options.explain_dir else [])


def check_trust_options(loaded, options: TrustOptions) -> None:
    """Usage errors (exit 2) before any image is read."""
    if options.explain_dir and loaded.kind != "checkpoint":
        raise ConfigError(f"--explain: Grad-CAM needs the model's layers and gradients, which {loaded.path} "
                          f"({loaded.kind} export) does not have; explain with the checkpoint it was exported from")
    if options.explain_dir and Path(options.explain_dir).exists() and not Path(options.explain_dir).is_dir():
        raise ConfigError(f"--explain {options.explain_dir}: a file is there; name a folder for the overlay PNGs")
    record = loaded.calibration
    if options.reject and options.reject_below is None and not (record and record.get("thresholds")):
        raise ConfigError(f"--reject: {loaded.path} stores no reject threshold (train.py stores one in best.pt "
                          f"after training; last.pt and older files have none); pass --reject-below X "
                          f"({LOGITS_METHOD} score: logsumexp of the logits) or use best.pt")


def build_rejector(loaded, options: TrustOptions, model_has_features: bool) -> Optional[Rejector]:
    """The reject scorer: the stored method where its inputs can be had (an export has logits only: energy),
    with `--reject-below` replacing the threshold."""
    if not options.rejecting:
        return None
    record = loaded.calibration
    if record and record.get("thresholds"):
        rejector = usable_rejector(record, model_has_features)
        if rejector.method != record["method"]:
            log.info("--reject: %s gives no penultimate features; using the %s score (threshold %.4g)",
                     loaded.path, rejector.method, rejector.threshold)
    else:
        rejector = Rejector(LOGITS_METHOD, 0.0)
    if options.reject_below is not None:
        rejector.threshold = float(options.reject_below)
    return rejector


class ScoreRecorder:
    """`predict(on_logits=...)`'s receiver: the reject score of every real row, in input order."""

    def __init__(self, model: torch.nn.Module, rejector: Rejector, head_name: Optional[str] = None):
        self.rejector = rejector
        self.tap = FeatureTap(model, head_name) if rejector.needs_features else None
        self.scores: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, n: int) -> None:
        features = self.tap.take() if self.tap is not None else None
        features = features[:n].float() if features is not None else None
        self.scores.append(self.rejector.scores(logits[:n].float(), features).cpu())

    def all_scores(self) -> torch.Tensor:
        return torch.cat(self.scores) if self.scores else torch.zeros(0)

    def clear(self) -> None:
        """Forget the scores so far (serve.py scores one batch at a time)."""
        self.scores.clear()

    def close(self) -> None:
        if self.tap is not None:
            self.tap.close()


def apply_reject(rows: list[dict], scores: torch.Tensor, rejector: Rejector) -> int:
    """Set `predicted` and `score` on every classified row and `label` = unknown where the score is below
    the threshold; returns how many were rejected."""
    rejected = 0
    for row, score in zip(rows, scores.tolist()):
        if row.get("error") is not None:
            continue
        row["predicted"], row["score"] = row["label"], score
        if score < rejector.threshold:
            row["label"] = UNKNOWN
            rejected += 1
    return rejected


def explain_rows(loaded, paths: list[str], rows: list[dict], classes: list[str], out_dir: str) -> None:
    """Grad-CAM for each classified row's predicted class (the would-be label of a rejected one): an overlay
    PNG in `out_dir` and `explain` = [{"label", "peak": [x, y], "overlay"}], peak in the original's pixels."""
    from data.images import load_rgb
    from data.transforms import normalize_batch
    from engine.evaluation.explain import (Explainer, crop_geometry, heatmap_on_original, heatmap_peak, to_original,
                                           write_overlay)

    model = loaded.build_model(torch.device("cpu"), channels_last=False)
    explainer = Explainer(model)
    log.info("--explain: Grad-CAM on layer '%s'", explainer.layer_name)
    transform = loaded.eval_transform()
    d = loaded.cfg.data
    todo = [i for i, row in enumerate(rows) if row.get("error") is None]
    out = Path(out_dir)
    try:
        for start in range(0, len(todo), EXPLAIN_BATCH):
            chunk = todo[start:start + EXPLAIN_BATCH]
            batch = normalize_batch(torch.stack([transform(paths[i]) for i in chunk]), d.mean, d.std)
            wanted = [classes.index(rows[i].get("predicted") or rows[i]["label"]) for i in chunk]
            cams = explainer.heatmaps(batch, wanted)
            for i, cam, c in zip(chunk, cams, wanted):
                original = np.asarray(load_rgb(paths[i]))
                height, width = original.shape[:2]
                geometry = crop_geometry(width, height, transform.resize_to, transform.img_size)
                peak = to_original(*heatmap_peak(cam), geometry, width, height)
                overlay = out / f"{i:05d}_{Path(paths[i]).stem}.png"
                write_overlay(original, heatmap_on_original(cam, geometry, width, height), overlay, peak)
                rows[i]["explain"] = [{"label": classes[c], "peak": peak, "overlay": str(overlay)}]
                rows[i]["explain_peak"] = f"{peak[0]} {peak[1]}"
                rows[i]["explain_overlay"] = str(overlay)
    finally:
        explainer.close()
