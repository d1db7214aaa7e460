"""The training loss (`train.loss`): cross-entropy, focal loss or binary cross-entropy, on int labels or on the
(batch, classes) soft targets of mixup / CutMix, optionally weighted per class (`train.class_weights`). Label smoothing composes with mixing as in timm (smoothing the
mixed distribution: targets x (1 - s) + s / classes). Validation always uses plain cross-entropy on hard
labels (tasks/metrics.py)."""
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


class AsymmetricLoss(torch.nn.Module):
    """The asymmetric loss of Ridnik et al. (ICCV 2021) for multi-label targets in [0, 1] (multi-hot, or mixed
    by mixup / CutMix): positives weighted by (1 - p)^gamma_pos, negatives by p_m^gamma_neg with the shifted
    probability p_m = max(p - clip, 0), so the many easy negatives of a multi-label set fade out and those
    below `clip` count not at all. Averaged over batch and classes, as `BinaryCrossEntropy` is, so the same
    LR suits both (the paper's code sums, which scales the gradient with batch and class count)."""

    EPS = 1e-8  # the paper's clamp of the probabilities inside the logs

    def __init__(self, gamma_neg: float = 4.0, gamma_pos: float = 0.0, clip: float = 0.05, smoothing: float = 0.0):
        super().__init__()
        self.smoothing = smoothing
        self.gamma_neg = gamma_neg
        self.gamma_pos = gamma_pos
        self.clip = clip

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # int labels (the batch-size finder's synthetic batches) become one-hot; smoothing as BinaryCrossEntropy's
        targets = smoothed_targets(targets, logits.shape[-1], self.smoothing).float()
        p = torch.sigmoid(logits.float())
        p_neg = (p - self.clip).clamp(min=0) if self.clip > 0 else p
        pos = targets * torch.log(p.clamp(min=self.EPS))
        neg = (1 - targets) * torch.log((1 - p_neg).clamp(min=self.EPS))
        if self.gamma_pos > 0:
            pos = pos * (1 - p).pow(self.gamma_pos)
        if self.gamma_neg > 0:
            neg = neg * p_neg.pow(self.gamma_neg)
        return -(pos + neg).mean()


def balanced_class_weights(counts: list[int]) -> list[float]:
    """`train.class_weights=balanced`: n_samples / (n_classes x count_c) per class (scikit-learn's `balanced`),
    from the training split's label counts: the mean weight over the split's samples is exactly 1, so the LR
    that suits the unweighted loss suits this one. A class without a training image gets 0."""
    total, num_classes = sum(counts), len(counts)
    return [total / (num_classes * count) if count else 0.0 for count in counts]


class WeightedFocalLoss(torch.nn.Module):
    """Softmax focal loss (Lin et al. 2017) with per-class weights on (smoothed or mixed) soft targets t:
    per sample -sum_c w_c t_c (1 - p_c)^gamma log p_c, so gamma = 0 is the class-weighted cross-entropy and a
    smoothed or mixed target is focused class by class. Reduced as the SUM over the batch divided by the batch
    size, not by the batch's sum of weights (torch's `mean` for class-index targets): each sample's share is then
    fixed by its own label, so accumulation windows and DDP ranks average to the loss of the whole batch exactly.
    `weights` None: all 1."""

    def __init__(self, gamma: float = 0.0, weights: Optional[list[float]] = None, smoothing: float = 0.0):
        super().__init__()
        self.gamma = gamma
        self.smoothing = smoothing
        self.register_buffer("weights", None if weights is None else torch.tensor(weights, dtype=torch.float32),
                             persistent=False)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        log_p = F.log_softmax(logits.float(), dim=-1)
        targets = smoothed_targets(targets, logits.shape[-1], self.smoothing).float()
        if self.weights is not None:
            if self.weights.device != logits.device:  # moved once, on the first batch
                self.weights = self.weights.to(logits.device)
            targets = targets * self.weights
        if self.gamma > 0:
            targets = targets * (1 - log_p.exp()).pow(self.gamma)
        return -(targets * log_p).sum() / logits.shape[0]


def build_criterion(train_cfg) -> torch.nn.Module:
    """`ce`: torch's cross-entropy, which takes int labels or soft (probability) targets and applies the
    label smoothing to both (with `train.class_weights`: `WeightedFocalLoss` at gamma 0); `focal`:
    `WeightedFocalLoss`; `bce`: `BinaryCrossEntropy`; `asl`: `AsymmetricLoss`. Both smooth multi-hot targets
    of data.task=multilabel as timm's BinaryCrossEntropy does: a tag present -> 1 - s + s / C, absent -> s / C."""
    if train_cfg.loss == "asl":
        return AsymmetricLoss(train_cfg.asl_gamma_neg, train_cfg.asl_gamma_pos, train_cfg.asl_clip,
                              train_cfg.label_smoothing)
    if train_cfg.loss == "bce":
        return BinaryCrossEntropy(train_cfg.label_smoothing, train_cfg.bce_target_thresh)
    weights = train_cfg.class_weights if isinstance(train_cfg.class_weights, list) else None
    if train_cfg.loss == "focal":
        return WeightedFocalLoss(train_cfg.focal_gamma, weights, train_cfg.label_smoothing)
    if train_cfg.class_weights != "none":  # `balanced` unresolved: measuring a step's cost only (no data read)
        return WeightedFocalLoss(0.0, weights, train_cfg.label_smoothing)
    return torch.nn.CrossEntropyLoss(label_smoothing=train_cfg.label_smoothing)
