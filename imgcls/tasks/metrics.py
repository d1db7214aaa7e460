"""Sums and rows of every process (no-ops in a single process): what makes a metric exact under DDP.

Sample-weighted single-label metrics (one class per image).

`MetricSums` keeps per-sample sums on the device (no host sync per batch); `reduce_metrics` turns the
sums into numbers. Under DDP the sums are all-reduced before reducing, so every sample counts once.

Multi-label metrics (`data.task: multilabel`): average precision per class and its macro mean (mAP), F1,
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

eval.py's report of a single-label model: the text table and the JSON document (INTERFACE keys first).

eval.py's report of a multi-label model: the text table and the JSON document."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from imgcls.tasks.rows import DEFAULT_THRESHOLD


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if distributed():
        dist.all_reduce(tensor)
    return tensor


def gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's rows, rank 0's first (a single process: `rows`). Ranks may hold different counts: each
    pads to the largest for the all_gather and the padding is cut off again."""
    if not distributed():
        return rows
    world = dist.get_world_size()
    count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    sizes = [int(c) for c in counts]
    padded = torch.zeros((max(sizes), *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])

class MetricSums:
    """Running sums over evaluated samples: loss, top-1/top-5 hits, per-class counts, confusion."""

    def __init__(self, num_classes: int, device: torch.device):
        self.num_classes = num_classes
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.top1 = torch.zeros((), dtype=torch.int64, device=device)
        self.topk = torch.zeros((), dtype=torch.int64, device=device)
        self.confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)  # samples with a NaN/inf logit

    @property
    def k(self) -> int:
        return min(5, self.num_classes)

    @torch.no_grad()
    def update(self, logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add a batch. `valid` masks out samples that must not count (unreadable eval files).

        Masking multiplies instead of indexing, so no step here waits for the device.
        """
        logits = logits.float()
        weight = torch.ones_like(targets) if valid is None else valid.to(targets.dtype)
        losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        self.loss_sum += (losses.double() * weight).sum()
        top = logits.topk(self.k, dim=1).indices
        hits = top == targets[:, None]
        self.top1 += (hits[:, 0].long() * weight).sum()
        self.topk += (hits.any(dim=1).long() * weight).sum()
        self.nonfinite += ((~torch.isfinite(logits).all(dim=1)).long() * weight).sum()
        flat = targets * self.num_classes + top[:, 0]
        self.confusion.view(-1).index_add_(0, flat, weight)

    def all_reduce(self) -> None:
        """Sum over processes (a no-op in a single process), so every sample counts once."""
        for t in (self.loss_sum, self.top1, self.topk, self.confusion, self.nonfinite):
            all_reduce_sum(t)

    def compute(self) -> dict:
        return reduce_metrics(self.loss_sum.item(), self.top1.item(), self.topk.item(), self.confusion.cpu())


def reduce_metrics(loss_sum: float, top1_hits: int, topk_hits: int, confusion: torch.Tensor) -> dict:
    """Turn sums into metrics. Rows of `confusion` are true classes, columns predictions.

    Accuracies are percentages. `mean_class_acc` (balanced accuracy) averages recall over the classes
    that have samples.
    """
    confusion = confusion.to(torch.float64)
    n = int(confusion.sum())
    per_class_count = confusion.sum(dim=1)
    per_class_hits = confusion.diagonal()
    present = per_class_count > 0
    recall = torch.where(present, per_class_hits / per_class_count.clamp(min=1), torch.zeros((), dtype=torch.float64))
    mean_class_acc = float(recall[present].mean() * 100) if present.any() else 0.0
    if n == 0:
        return {"top1": 0.0, "top5": 0.0, "loss": float("nan"), "mean_class_acc": 0.0, "num_samples": 0}
    return {
        "top1": 100.0 * top1_hits / n,
        "top5": 100.0 * topk_hits / n,
        "loss": loss_sum / n,
        "mean_class_acc": mean_class_acc,
        "num_samples": n,
    }


def per_class_report(confusion: torch.Tensor, classes: list[str]) -> dict:
    """Precision, recall (= accuracy of that class), F1 and count per class name."""
    confusion = confusion.to(torch.float64)
    hits = confusion.diagonal()
    count = confusion.sum(dim=1)
    predicted = confusion.sum(dim=0)
    report = {}
    for i, name in enumerate(classes):
        recall = float(hits[i] / count[i]) if count[i] > 0 else 0.0
        precision = float(hits[i] / predicted[i]) if predicted[i] > 0 else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
        report[name] = {"accuracy": 100.0 * recall, "precision": 100.0 * precision, "recall": 100.0 * recall,
                        "f1": 100.0 * f1, "count": int(count[i])}
    return report


def top5_label(k: int) -> str:
    """`top5` everywhere (logs, metrics.csv, TensorBoard, JSON); with fewer than 5 classes it is top-k at k =
    the class count, which the text says beside it."""
    return "top5" if k >= 5 else f"top5 (k={k})"

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


def precision_recall_curve(scores: torch.Tensor, positives: torch.Tensor) -> tuple[list[float], list[float]]:
    """(recall, precision) at each distinct threshold, highest first (scikit-learn's points)."""
    total = float(positives.sum())
    if total == 0:
        return [], []
    _, tp, fp = ranked_counts(scores, positives)
    return (tp / total).tolist(), (tp / (tp + fp)).tolist()


def single_label_precision_recall(probs: torch.Tensor, labels: torch.Tensor, classes: list[str]) -> dict:
    """One-vs-rest average precision of each class from the [N, C] probabilities infer.py writes and the int
    labels: `average_precision` (name -> AP as a fraction, sklearn.metrics.average_precision_score's number;
    None for a class without an image in the split) and `pr_auc_macro`, their mean over the classes with one."""
    positives = labels[:, None] == torch.arange(len(classes))[None, :]
    aps = [average_precision(probs[:, c], positives[:, c]) for c in range(len(classes))]
    present = [ap for ap in aps if not math.isnan(ap)]
    return {"average_precision": {name: None if math.isnan(ap) else ap for name, ap in zip(classes, aps)},
            "pr_auc_macro": sum(present) / len(present) if present else None}


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

def eval_document(keys: list[str], metrics: dict, per_class: dict, confusion: torch.Tensor, classes: list[str],
                  **extra) -> dict:
    """The eval JSON: the declared metrics (INTERFACE keys) first, then whatever else the caller records
    (checkpoint, split...)."""
    doc = {k: metrics[k] for k in keys}
    doc["top5_k"] = min(5, len(classes))  # top5 is top-k at k = min(5, classes)
    doc["per_class"] = per_class
    doc["confusion"] = confusion.to(torch.int64).tolist()
    doc["classes"] = list(classes)
    doc.update(extra)
    return doc


def format_eval_table(metrics: dict, per_class: dict, k: int) -> str:
    lines = [
        f"top1 {metrics['top1']:.2f}%   {top5_label(k)} {metrics['top5']:.2f}%   loss {metrics['loss']:.4f}   "
        f"mean class acc {metrics['mean_class_acc']:.2f}%   samples {metrics['num_samples']}",
        "",
    ]
    width = max([len("class")] + [len(name) for name in per_class])
    # a class's accuracy is its recall (the share of its images predicted as it): one column, named for both
    header = f"{'class':<{width}}  {'count':>6}  {'recall% (acc)':>13}  {'prec%':>6}  {'f1%':>6}"
    lines += [header, "-" * len(header)]
    for name, row in per_class.items():
        lines.append(f"{name:<{width}}  {row['count']:>6d}  {row['recall']:>13.2f}  {row['precision']:>6.2f}  "
                     f"{row['f1']:>6.2f}")
    return "\n".join(lines)

def multilabel_document(keys: list[str], metrics: dict, per_class: dict, classes: list[str], **extra) -> dict:
    """The eval JSON of a multi-label model: mAP, F1 / precision / recall at the model's thresholds and at
    0.5, `per_class` (name -> ap, f1, precision, recall, threshold, positives), then the caller's extras."""
    doc = {k: metrics[k] for k in keys}
    doc["per_class"] = per_class
    doc["classes"] = list(classes)
    doc.update(extra)
    return doc


def format_multilabel_table(metrics: dict, per_class: dict) -> str:
    m = metrics
    mean_ap = "undefined (no tag in the split)" if m["mAP"] is None else f"{m['mAP']:.2f}%"
    lines = [f"mAP {mean_ap}   micro F1 {m['micro_f1']:.2f}%   macro F1 {m['macro_f1']:.2f}%   precision "
             f"{m['precision']:.2f}%   recall {m['recall']:.2f}%   loss {m['loss']:.4f}   samples {m['num_samples']}",
             f"at threshold 0.5: micro F1 {m['micro_f1_at_0.5']:.2f}%   macro F1 {m['macro_f1_at_0.5']:.2f}%   "
             f"precision {m['precision_at_0.5']:.2f}%   recall {m['recall_at_0.5']:.2f}%", ""]
    width = max([len("class")] + [len(name) for name in per_class])
    header = f"{'class':<{width}}  {'positives':>9}  {'ap%':>6}  {'f1%':>6}  {'prec%':>6}  {'recall%':>7}  {'threshold':>9}"
    lines += [header, "-" * len(header)]
    for name, row in per_class.items():
        ap = "-" if row["ap"] is None else f"{row['ap']:.2f}"
        lines.append(f"{name:<{width}}  {row['positives']:>9d}  {ap:>6}  {row['f1']:>6.2f}  {row['precision']:>6.2f}  "
                     f"{row['recall']:>7.2f}  {row['threshold']:>9.4f}")
    return "\n".join(lines)
