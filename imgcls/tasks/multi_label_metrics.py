"""Multi-label metrics (`data.task: multilabel`): average precision per class and its macro mean (mAP), F1,
precision and recall at per-class thresholds, and the thresholds that maximise each class's F1.

Average precision needs every score of the split, not a running sum: `MultiLabelSums` keeps this rank's
sigmoid probabilities and targets on the device, and `all_reduce` gathers every rank's rows (the eval
sampler gives each sample to one rank and pads nothing, so every sample counts once). The numbers are
then a function of the multiset of (score, target) rows, whatever their order: ties are grouped as
scikit-learn groups them, so `mAP` equals `sklearn.metrics.average_precision_score(average="macro")`
over the classes that have a positive, and a DDP evaluation equals a single-process one.

Scores are float32 sigmoid probabilities, the numbers infer.py writes: a ranking of saturated logits
that float32 rounds to 1.0 ties exactly as it does in infer.py's output. A sample is predicted positive
for a class when its probability (as float64) is >= the class's threshold.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from imgcls.tasks.gather import all_reduce_sum, gather_rows
from imgcls.tasks.multi_label_rows import DEFAULT_THRESHOLD


def ranked_counts(scores: torch.Tensor, positives: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For one class: the distinct scores in descending order, and the true and false positives when every
    sample scoring at least that much is called positive (float64 counts)."""
    order = torch.argsort(scores, descending=True, stable=True)
    ranked = scores[order]
    hits = positives[order].to(torch.float64)
    ends = torch.nonzero(ranked[1:] != ranked[:-1]).flatten()
    ends = torch.cat([ends, torch.tensor([len(ranked) - 1])])  # the last row of each group of equal scores
    tp = hits.cumsum(0)[ends]
    fp = (ends + 1).to(torch.float64) - tp
    return ranked[ends], tp, fp


def average_precision(scores: torch.Tensor, positives: torch.Tensor) -> float:
    """AP = sum over distinct thresholds of (recall step) x precision; NaN for a class without positives."""
    total = float(positives.sum())
    if total == 0:
        return float("nan")
    _, tp, fp = ranked_counts(scores, positives)
    precision = tp / (tp + fp)
    recall_step = torch.diff(tp, prepend=torch.zeros(1, dtype=torch.float64)) / total
    return float((recall_step * precision).sum())


def best_f1_threshold(scores: torch.Tensor, positives: torch.Tensor) -> float:
    """The threshold that maximises the class's F1 (the highest such on a tie): half-way between the lowest
    score called positive and the next lower score, so a rounding difference in an exported model's scores
    does not flip a call. DEFAULT_THRESHOLD for a class without positives (no F1 to maximise)."""
    total = float(positives.sum())
    if total == 0 or len(scores) == 0:
        return DEFAULT_THRESHOLD
    distinct, tp, fp = ranked_counts(scores.double(), positives)
    f1 = 2 * tp / (tp + fp + total)
    k = int(torch.argmax(f1))
    below = float(distinct[k + 1]) if k + 1 < len(distinct) else 0.0
    return (float(distinct[k]) + below) / 2


def tune_thresholds(scores: torch.Tensor, targets: torch.Tensor) -> list[float]:
    """Per class, the threshold that maximises its F1 on (scores, targets) ([N, C] each)."""
    positives = targets > 0.5
    return [best_f1_threshold(scores[:, c], positives[:, c]) for c in range(scores.shape[1])]


def predicted(scores: torch.Tensor, thresholds: list[float]) -> torch.Tensor:
    """[N, C] bool: probability >= the class's threshold (compared in float64)."""
    return scores.double() >= torch.tensor(thresholds, dtype=torch.float64)


def f1_figures(calls: torch.Tensor, positives: torch.Tensor) -> tuple[dict, dict]:
    """(micro and macro figures in percent, per-class precision / recall / F1 in percent); the macro mean is
    over the classes with a positive, as mAP is."""
    tp = (calls & positives).sum(0).double()
    fp = (calls & ~positives).sum(0).double()
    fn = (~calls & positives).sum(0).double()
    has = (tp + fn) > 0
    f1 = torch.where(tp > 0, 2 * tp / (2 * tp + fp + fn), torch.zeros_like(tp))
    precision = torch.where(tp + fp > 0, tp / (tp + fp).clamp(min=1), torch.zeros_like(tp))
    recall = torch.where(has, tp / (tp + fn).clamp(min=1), torch.zeros_like(tp))
    TP, FP, FN = float(tp.sum()), float(fp.sum()), float(fn.sum())
    overall = {"micro_f1": 100 * 2 * TP / (2 * TP + FP + FN) if TP > 0 else 0.0,
               "macro_f1": 100 * float(f1[has].mean()) if has.any() else 0.0,
               "precision": 100 * TP / (TP + FP) if TP + FP > 0 else 0.0,
               "recall": 100 * TP / (TP + FN) if TP + FN > 0 else 0.0}
    per_class = {"f1": (100 * f1).tolist(), "precision": (100 * precision).tolist(), "recall": (100 * recall).tolist()}
    return overall, per_class


def multilabel_metrics(scores: torch.Tensor, targets: torch.Tensor, classes: list[str], loss_sum: float,
                       thresholds: Optional[list[float]] = None) -> dict:
    """Every multi-label number of a split from its [N, C] probabilities and 0/1 targets (CPU). Without
    `thresholds` they are tuned here (max F1 per class); `thresholds` in the result are those used. F1,
    precision and recall are also given at 0.5 (`*_at_0.5`)."""
    n = scores.shape[0]
    positives = targets > 0.5
    thresholds = list(thresholds) if thresholds is not None else tune_thresholds(scores, targets)
    aps = [average_precision(scores[:, c], positives[:, c]) for c in range(len(classes))]
    present = [ap for ap in aps if not math.isnan(ap)]
    overall, per = f1_figures(predicted(scores, thresholds), positives)
    at_half, _ = f1_figures(predicted(scores, [DEFAULT_THRESHOLD] * len(classes)), positives)
    counts = positives.sum(0).tolist()
    per_class = {name: {"ap": 100 * aps[c] if not math.isnan(aps[c]) else None, "f1": per["f1"][c],
                        "precision": per["precision"][c], "recall": per["recall"][c], "threshold": thresholds[c],
                        "positives": int(counts[c])} for c, name in enumerate(classes)}
    # no class with a positive: mAP is undefined (None), not 0 (best.pt is then chosen by loss: tasks.deciding_metric)
    return {"mAP": 100 * sum(present) / len(present) if present else None, **overall,
            **{f"{k}_at_0.5": v for k, v in at_half.items()},
            "loss": loss_sum / n if n else float("nan"), "num_samples": n,
            "thresholds": thresholds, "per_class": per_class}


class MultiLabelSums:
    """The evaluation pass's record for multi-label data: this rank's probabilities and targets (kept on the
    device until the end) and the BCE loss sum; `compute` gives `multilabel_metrics`."""

    def __init__(self, num_classes: int, device: torch.device, classes: Optional[list[str]] = None):
        self.num_classes = num_classes
        self.classes = classes or [str(c) for c in range(num_classes)]
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.scores: Optional[torch.Tensor] = None
        self.targets: Optional[torch.Tensor] = None

    @torch.no_grad()
    def update(self, logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        logits, targets = logits.float(), targets.float()
        valid = torch.ones(len(logits), dtype=torch.bool, device=logits.device) if valid is None else valid.bool()
        losses = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction="none").mean(1)
        self.loss_sum += (losses.double() * valid).sum()
        self.parts.append((torch.sigmoid(logits), targets, valid))

    def _rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's valid rows (one host sync: the mask decides the count)."""
        if self.scores is None:
            if not self.parts:
                empty = torch.zeros(0, self.num_classes, device=self.loss_sum.device)
                return empty, empty.clone()
            scores, targets, valid = (torch.cat(t) for t in zip(*self.parts))
            self.scores, self.targets = scores[valid], targets[valid]
        return self.scores, self.targets

    def all_reduce(self) -> None:
        """Every rank's rows and the summed loss on every rank (a no-op in a single process)."""
        scores, targets = self._rows()
        self.scores, self.targets = gather_rows(scores), gather_rows(targets)
        all_reduce_sum(self.loss_sum)

    def compute(self, thresholds: Optional[list[float]] = None) -> dict:
        scores, targets = self._rows()
        return multilabel_metrics(scores.cpu(), targets.cpu(), self.classes, self.loss_sum.item(), thresholds)
