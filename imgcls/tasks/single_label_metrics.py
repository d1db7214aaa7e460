"""Sample-weighted single-label metrics (one class per image).

`MetricSums` keeps per-sample sums on the device (no host sync per batch); `reduce_metrics` turns the
sums into numbers. Under DDP the sums are all-reduced before reducing, so every sample counts once.
"""
from __future__ import annotations

import torch

from imgcls.tasks.gather import all_reduce_sum


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
