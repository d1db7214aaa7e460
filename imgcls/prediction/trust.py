"""The trust options of infer.py and serve.py: the reject option (`--reject`, `--reject-below X`) and Grad-CAM explanations
(`--explain DIR`), kept apart from the prediction pass; the scoring itself is evaluation's.

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

from imgcls.core.errors import ConfigError
from imgcls.evaluation.rejection import LayerTap, LOGITS_METHOD, Rejector
from imgcls.evaluation.trust import usable_rejector
from imgcls.models.feature_tap import FeatureTap
from imgcls.tasks.single_label_rows import EXPLAIN_COLUMNS, reject_rows

log = logging.getLogger(__name__)

REJECT_COLUMNS = ["predicted", "score"]
EXPLAIN_BATCH = 16
OVERLAY_MAX_SIDE = 1024  # an overlay's longer side, in pixels (the original scaled down to it when larger)


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


def build_rejector(loaded, options: TrustOptions, model_has_features: bool,
                   model_has_layers: bool = True) -> Optional[Rejector]:
    """The reject scorer: the stored method where its inputs can be had (an export has logits only: energy),
    with `--reject-below` replacing the threshold."""
    if not options.rejecting:
        return None
    record = loaded.calibration
    if record and record.get("thresholds"):
        rejector = usable_rejector(record, model_has_features, have_layers=model_has_layers)
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
        self.layer_tap = LayerTap(model, rejector.layer_names) if rejector.needs_layers else None
        self.scores: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, n: int) -> None:
        features = self.tap.take() if self.tap is not None else None
        features = features[:n].float() if features is not None else None
        layers = self.layer_tap.take() if self.layer_tap is not None else None
        layers = [x[:n] for x in layers] if layers is not None else None
        self.scores.append(self.rejector.scores(logits[:n].float(), features, layers).cpu())

    def all_scores(self) -> torch.Tensor:
        return torch.cat(self.scores) if self.scores else torch.zeros(0)

    def clear(self) -> None:
        """Forget the scores so far (serve.py scores one batch at a time)."""
        self.scores.clear()

    def close(self) -> None:
        for tap in (self.tap, self.layer_tap):
            if tap is not None:
                tap.close()


def apply_reject(rows: list[dict], scores: torch.Tensor, rejector: Rejector) -> int:
    """The reject option on the rows (tasks.single_label_rows.reject_rows, the slim server's too): `predicted`
    and `score` on every classified row, `label` = unknown below the threshold; returns how many."""
    return reject_rows(rows, scores.numpy(), rejector.threshold)


def explain_items(rows: list[dict], classes: list[str], task) -> list[tuple[int, int]]:
    """(row position, class index) of every overlay to draw: the classes `task.explained_labels` names in each
    classified row (the predicted class, the would-be label of a rejected one; a multi-label row's called tags)."""
    items = []
    for i, row in enumerate(rows):
        if row.get("error") is not None:
            continue
        items += [(i, classes.index(name)) for name in task.explained_labels(row)]
    return items


def overlay_name(position: int, path: str, tag: Optional[str]) -> str:
    """`00007_stem.png`, or `00007_stem.tag.png` for one of several tags (the tag's unsafe characters as _):
    the position keeps two inputs of one name apart; the folder holds no input (core.outputs)."""
    stem = Path(path).stem
    if tag is None:
        return f"{position:05d}_{stem}.png"
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in tag)
    return f"{position:05d}_{stem}.{safe}.png"


def display_size(width: int, height: int, max_side: int = OVERLAY_MAX_SIDE) -> tuple[int, int, float]:
    """(width, height, factor) of the overlay: the original scaled down so its longer side is at most
    `max_side` (a 9000 px photo made a 142 MB overlay and gigabytes of float canvases)."""
    factor = min(1.0, max_side / max(width, height))
    return max(1, round(width * factor)), max(1, round(height * factor)), factor


def overlay_base(path: str, d) -> tuple:
    """(width, height, display width, display height, factor, shown pixels) of the image an overlay is drawn
    on: the file as 8-bit RGB, or for data.channels other than 3 its first band stretched between its extremes."""
    from PIL import Image

    from imgcls.data.bands import first_band_view
    from imgcls.data.images import load_rgb, open_image, oriented_size
    from imgcls.data.transforms import read_band_array, reads_bands

    if reads_bands(d.channels, d.value_range):
        image = first_band_view(read_band_array(path, d.channels, d.value_range))
        width, height = image.size
        dw, dh, factor = display_size(width, height)
    else:
        with open_image(path) as header:  # the size from the header; a JPEG decodes at the
            width, height = oriented_size(header)  # overlay's size (draft), not at 9000 px
        dw, dh, factor = display_size(width, height)
        image = load_rgb(path, min_size=(dw, dh))
    shown = np.asarray(image if image.size == (dw, dh) else image.resize((dw, dh), Image.Resampling.BOX))
    return width, height, dw, dh, factor, shown


def explain_rows(loaded, paths: list[str], rows: list[dict], classes: list[str], out_dir: str) -> None:
    """Grad-CAM for each class the model's task explains in a classified row (the predicted class; each of a
    multi-label row's called tags, the overlay named by the tag): an overlay PNG in `out_dir` (longer side at most OVERLAY_MAX_SIDE) and
    `explain` = [{"label", "peak": [x, y], "peak_informative", "overlay", "layer"}], peak in the original's
    pixels, `layer` the one Grad-CAM read (`evaluation.explain.target_layer`: fine enough for the input size).
    A flat heatmap (a feature map of one cell, as at 32 px) has no peak: `peak_informative` is false and
    the peak is the crop's first pixel, which means nothing."""
    from imgcls.data.transforms import normalize_batch
    from imgcls.evaluation.explain import (Explainer, crop_geometry, heatmap_on_original, heatmap_peak, to_original,
                                           write_overlay)
    model = loaded.build_model(torch.device("cpu"), channels_last=False)
    transform = loaded.eval_transform()
    explainer = Explainer(model, transform.img_size)
    log.info("--explain: Grad-CAM on layer %s at %d px", explainer.describe(), transform.img_size)
    d = loaded.cfg.data
    items = explain_items(rows, classes, loaded.task)
    several = loaded.task.explains_each_label
    out = Path(out_dir)
    flat = 0
    try:
        for start in range(0, len(items), EXPLAIN_BATCH):
            chunk = items[start:start + EXPLAIN_BATCH]
            batch = normalize_batch(torch.stack([transform(paths[i]) for i, _ in chunk]), d.mean, d.std)
            cams = explainer.heatmaps(batch, [c for _, c in chunk])
            for (i, c), cam in zip(chunk, cams):
                width, height, dw, dh, factor, shown = overlay_base(paths[i], d)
                geometry = crop_geometry(width, height, transform.resize_to, transform.img_size)
                informative = bool(cam.max() - cam.min() > 1e-6)
                flat += not informative
                peak = to_original(*heatmap_peak(cam), geometry, width, height)
                left, top, sx, sy = geometry
                heat = heatmap_on_original(cam, (left, top, sx / factor, sy / factor), dw, dh)
                overlay = out / overlay_name(i, paths[i], classes[c] if several else None)
                write_overlay(shown, heat, overlay, [round(peak[0] * factor), round(peak[1] * factor)]
                              if informative else None)
                rows[i].setdefault("explain", []).append({"label": classes[c], "peak": peak,
                                                          "peak_informative": informative, "overlay": str(overlay),
                                                          "layer": explainer.layer_name})
        for row in rows:
            if row.get("explain"):
                row["explain_peak"] = " | ".join(f"{e['peak'][0]} {e['peak'][1]}" for e in row["explain"])
                row["explain_overlay"] = " | ".join(e["overlay"] for e in row["explain"])
    finally:
        explainer.close()
    if flat:
        log.warning("--explain: %d of %d heatmap(s) are flat (the read layer's feature map has one cell at "
                    "this input size, or the class gets no gradient): their peak carries no information "
                    "(peak_informative false)", flat, len(items))
