"""The training loss (`train.loss`): cross-entropy or binary cross-entropy, on int labels or on the (batch,
classes) soft targets of mixup / CutMix. Label smoothing composes with mixing as in timm (smoothing the
mixed distribution: targets x (1 - s) + s / classes). Validation always uses plain cross-entropy on hard
labels (engine/evaluation/metrics.py)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def smoothed_targets(targets: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    """(batch, classes) float targets from int labels or soft targets, smoothed towards uniform."""
    if not targets.is_floating_point():
        targets = F.one_hot(targets, num_classes).float()
    return targets * (1.0 - smoothing) + smoothing / num_classes if smoothing > 0 else targets


class BinaryCrossEntropy(torch.nn.Module):
    """ResNet strikes back's loss: per-class sigmoid BCE on one-hot / mixed targets (smoothed), optionally
    binarised at `target_thresh` (a class counts as present above it), averaged over batch and classes."""

    def __init__(self, smoothing: float = 0.0, target_thresh: Optional[float] = None):
        super().__init__()
        self.smoothing = smoothing
        self.target_thresh = target_thresh

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets = smoothed_targets(targets, logits.shape[-1], self.smoothing)
        if self.target_thresh is not None:
            targets = (targets > self.target_thresh).float()
        return F.binary_cross_entropy_with_logits(logits.float(), targets)


def build_criterion(train_cfg) -> torch.nn.Module:
    """`ce`: torch's cross-entropy, which takes int labels or soft (probability) targets and applies the
    label smoothing to both; `bce`: `BinaryCrossEntropy`."""
    if train_cfg.loss == "bce":
        return BinaryCrossEntropy(train_cfg.label_smoothing, train_cfg.bce_target_thresh)
    return torch.nn.CrossEntropyLoss(label_smoothing=train_cfg.label_smoothing)
