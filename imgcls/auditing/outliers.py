"""Out-of-distribution images in the data (audit.py's `outliers`): each fold model scores the images it did
not train on with the reject option's feature score (the Mahalanobis distance of the L2-normalised penultimate
features: evaluation/rejection.py, fitted by the fold run's calibration on its training images), standardised
within the fold and within the class each image is filed under, by that class's median and median absolute
deviation (robust to the outliers themselves); an image below -OUTLIER_Z is flagged: a cat, a retina scan or a
logo filed among photos of another kind. Per class because classes spread differently in feature space: over
the pooled fold, the ordinary images of a varied class were most of the flags (19 of 21 in a user's audit).
Grayscale images in a class of colour ones are flagged too (auditing/duplicates.py), with or without a model."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch

# the feature score alone: the energy of a whole class can sit apart from the others, and standardised over the
# pooled fold it flagged every image of that class (a 3-class audit: 15 of one class at z -6 to -7)
OUTLIER_PARTS = ("mahalanobis_l2",)
OUTLIER_Z = 6.0          # robust standard deviations below the fold's median (ordinary images of a test audit reached -4.6)
MAX_OUTLIERS_SHOWN = 200


def robust_z(scores: torch.Tensor) -> torch.Tensor:
    """(score - median) / (1.4826 x median absolute deviation): a standard score that the tail does not move."""
    values = scores.double()
    median = values.median()
    mad = (values - median).abs().median() * 1.4826
    return ((values - median) / (mad if mad > 1e-12 else 1.0)).float()


MIN_CLASS_SCORES = 8     # fewer held-out images of a class in a fold: standardised over the fold's pool instead


def robust_z_by_class(scores: torch.Tensor, labels: Optional[list[int]] = None) -> torch.Tensor:
    """`robust_z` within each label's scores (labels with fewer than MIN_CLASS_SCORES finite scores: against the
    pooled scores); the pooled `robust_z` without labels."""
    finite = torch.isfinite(scores)
    pooled = torch.full_like(scores, math.nan, dtype=torch.float32)
    if finite.any():
        pooled[finite] = robust_z(scores[finite])
    if labels is None:
        return pooled
    out = pooled.clone()
    labels_t = torch.as_tensor(labels)
    for label in labels_t.unique().tolist():
        members = (labels_t == label) & finite
        if int(members.sum()) >= MIN_CLASS_SCORES:
            out[members] = robust_z(scores[members])
    return out


def lowest_z(parts: list[torch.Tensor], labels: Optional[list[int]] = None) -> torch.Tensor:
    return torch.stack([robust_z_by_class(p, labels) for p in parts]).min(dim=0).values


def fold_outlier_z(opened, files: list[str], num_workers: int,
                   labels: Optional[list[int]] = None) -> Optional[torch.Tensor]:
    """The lowest robust z of OUTLIER_PARTS for each of `files` (filed under `labels`: standardised per class)
    under the fold's calibrated best.pt (`opened`: folds.open_model's (ModelFile, model, device, amp dtype));
    None when it holds no feature fits (a model without a timm classifier); nan for an unreadable file."""
    from imgcls.compute.device import DeviceInput
    from imgcls.data.build import build_eval_loader_for
    from imgcls.data.listing import ImageIndex
    from imgcls.evaluation.rejection import collect_outputs, rejector_from_record

    loaded, model, device, amp = opened
    record = loaded.calibration
    if not record or record.get("class_means_l2") is None:
        return None
    rejector = rejector_from_record(record, "energy")
    index = ImageIndex(Path(files[0]).parent, list(loaded.classes), list(files), [0] * len(files))
    batch = loaded.cfg.train.batch_size if isinstance(loaded.cfg.train.batch_size, int) else 64
    loader = build_eval_loader_for(index, loaded.eval_transform(), loaded.cfg.data.img_size, batch, num_workers,
                                   False)
    out = collect_outputs(model, loader, DeviceInput.from_config(loaded.cfg, device, amp), with_features=True)
    if out.features is None:
        return None
    z = torch.full((len(files),), math.nan)
    held = [labels[i] for i in out.indices.tolist()] if labels is not None else None
    z[out.indices] = lowest_z([rejector.score(p, out.logits, out.features).cpu() for p in OUTLIER_PARTS], held)
    return z


def find_outliers(names: list[str], splits: list[str], labels: list[str], z: torch.Tensor,
                  limit: float = OUTLIER_Z) -> list[dict]:
    """[{"path", "split", "given", "score", "reason"}] of the images below -limit, the most foreign first."""
    rows = [{"path": n, "split": s, "given": g, "score": round(float(v), 2),
             "reason": f"unlike the other images of {g} to the fold model (robust z {v:.1f})"}
            for n, s, g, v in zip(names, splits, labels, z.tolist()) if math.isfinite(v) and v < -limit]
    return sorted(rows, key=lambda r: (r["score"], r["path"]))


def merge_outliers(by_model: Optional[list[dict]], grayscale: list[dict]) -> Optional[list[dict]]:
    """The fold models' rows (None: not searched) and the grayscale rows as one list: an image in both keeps
    its score and both reasons; grayscale-only ones follow the scored ones. None when neither found anything
    and the models did not search."""
    if by_model is None and not grayscale:
        return None
    rows = [dict(r) for r in (by_model or [])]
    at = {r["path"]: r for r in rows}
    for gray in grayscale:
        if gray["path"] in at:
            at[gray["path"]]["reason"] += "; " + gray["reason"]
        else:
            rows.append(dict(gray))
    return rows


def outliers_summary(outliers: Optional[list], searched: bool = True) -> str:
    """One line for the report's summary, of the merged list (`merge_outliers`, what `outliers` holds): the
    fold models' rows and the grayscale ones. `searched`: whether a model looked (False: the grayscale rule
    alone ran)."""
    gray = sum(o.get("score") is None for o in outliers or [])
    by_model = (f"unlike the rest of their class to the fold models: {len(outliers or []) - gray}" if searched else
                "not searched by a model (fold training only; a --checkpoint audit does not)")
    if not outliers:
        return (f"out-of-distribution images: {by_model}; no grayscale image among colour ones" if not searched else
                f"0 out-of-distribution image(s) ({by_model}; no grayscale image among colour ones)")
    return (f"{len(outliers)} out-of-distribution image(s) ({by_model}; grayscale among colour images: {gray}; "
            f"look at them: another kind of image filed under a class)")


def outliers_section(report: dict, figure) -> str:
    """The HTML section of the outliers; `figure(name, caption)` draws a thumbnail."""
    outliers = report.get("outliers")
    head = f"<h2>Out-of-distribution images ({len(outliers or [])})</h2>"
    if outliers is None:
        return head + '<p class="note">not searched</p>'
    if not outliers:
        return head + '<p class="note">no out-of-distribution images found</p>'
    def caption(o: dict) -> str:
        return f"{o['given']} ({'grayscale' if o.get('score') is None else 'z ' + str(o['score'])})"

    rows = "".join(figure(o["path"], caption(o)) for o in outliers[:MAX_OUTLIERS_SHOWN])
    return (head + f'<p class="note">robust z-score of the fold models\' feature reject score, within the class, '
            f'below -{OUTLIER_Z:g} (the most foreign first), then grayscale images in classes of colour '
            f'ones</p><div class="row outlier">{rows}</div>')
