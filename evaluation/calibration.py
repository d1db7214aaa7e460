"""Calibrated probabilities: temperature scaling (Guo et al., 2017), expected calibration error, NLL and
selective-prediction figures, as pure functions of logits and labels (infer.py, eval.py, a server and the
post-training fit all call these).

Temperature scaling divides the logits by one number T > 0 before the softmax, so the argmax never
changes; T is fitted on the validation split's logits by minimising the NLL.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from core.temperature import MAX_TEMPERATURE, MIN_TEMPERATURE

ECE_BINS = 15
# the fitted temperature stays within core.temperature's bounds (log-space search); a split too small or too
# easy to pin it down (every sample right with any confidence) ends at a bound rather than at 0 or infinity
# below this many validation images the fitted temperature is reported as uncertain
MIN_CALIBRATION_SAMPLES = 100
# a temperature below 1 (sharper than the plain softmax) needs at least this many validation errors to rest on
MIN_CALIBRATION_ERRORS = 5


def apply_temperature(logits: torch.Tensor, temperature: Optional[float]) -> torch.Tensor:
    """Probabilities from logits scaled by 1 / temperature (None or 1: the plain softmax)."""
    logits = logits.float()
    if temperature is not None and temperature != 1.0:
        logits = logits / temperature
    return logits.softmax(dim=-1)


def nll(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> float:
    """Mean negative log-likelihood of `labels` under softmax(logits / temperature)."""
    scaled = logits.double() / temperature
    return float(torch.nn.functional.cross_entropy(scaled, labels.long(), reduction="mean"))


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The T that minimises the NLL of softmax(logits / T): LBFGS on log T (the NLL is smooth and has one
    minimum in log T), in float64, clamped to [MIN_TEMPERATURE, MAX_TEMPERATURE]. 1.0 with no samples."""
    if len(labels) == 0:
        return 1.0
    logits, labels = logits.detach().double(), labels.long()
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([log_t], lr=0.5, max_iter=200, tolerance_grad=1e-10, tolerance_change=1e-12,
                                  line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(logits / log_t.exp(), labels)
        loss.backward()
        return loss
    optimizer.step(closure)
    t = float(log_t.detach().exp())
    if not math.isfinite(t):  # NaN logits or labels the NLL cannot fit: the plain softmax
        return 1.0
    return min(max(t, MIN_TEMPERATURE), MAX_TEMPERATURE)


@dataclass
class TemperatureFit:
    """The temperature to use, the NLL fit's own value, and what limited it (`notes`: plain sentences for the
    log and eval.py; empty when the fit stands as it is)."""

    temperature: float
    fitted: float
    errors: int
    notes: list[str] = field(default_factory=list)


def calibrated_temperature(logits: torch.Tensor, labels: torch.Tensor) -> TemperatureFit:
    """The NLL fit (`fit_temperature`) under the rule that calibration never makes a model more confident
    than its plain softmax without errors to calibrate against: with fewer than MIN_CALIBRATION_ERRORS
    misclassified validation images, T < 1 is raised to 1 (a split the model gets all right drives the fit
    to its lower bound, which calls anything, a foreign image too, at probability 1.0000). A fit that ends at
    a bound, and a split under MIN_CALIBRATION_SAMPLES images, are said in `notes`."""
    n = len(labels)
    fitted = fit_temperature(logits, labels)
    errors = int((logits.argmax(1) != labels.long()).sum()) if n else 0
    notes = []
    if n and n < MIN_CALIBRATION_SAMPLES:
        notes.append(f"only {n} validation images (under {MIN_CALIBRATION_SAMPLES}): the temperature is uncertain")
    if fitted <= MIN_TEMPERATURE * (1 + 1e-6) or fitted >= MAX_TEMPERATURE * (1 - 1e-6):
        bound = "lower" if fitted < 1 else "upper"
        notes.append(f"the fit ended at its {bound} bound ({fitted:g}): the validation split cannot pin the "
                     f"temperature down")
    temperature = fitted
    if fitted < 1.0 and errors < MIN_CALIBRATION_ERRORS:
        temperature = 1.0
        notes.append(f"the validation split has {errors} error(s) (under {MIN_CALIBRATION_ERRORS}): nothing to "
                     f"calibrate a sharper softmax against, so the temperature is kept at 1.0 (fit: {fitted:.4g}), "
                     f"never more confident than uncalibrated")
    return TemperatureFit(temperature, fitted, errors, notes)


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, bins: int = ECE_BINS) -> float:
    """Top-1 ECE in percent: the confidences (max probability) fall into `bins` equal-width bins over
    (0, 1]; the sum over bins of (samples in bin / all samples) x |accuracy - mean confidence| in the bin."""
    n = len(labels)
    if n == 0:
        return 0.0
    confidence, predicted = probs.double().max(dim=1)
    correct = (predicted == labels.long()).double()
    # bin b holds confidences in (b / bins, (b + 1) / bins]; a confidence of exactly 0 joins the first bin
    which = (confidence * bins).ceil().long().clamp(1, bins) - 1
    conf_sum = torch.zeros(bins, dtype=torch.float64).index_add_(0, which, confidence)
    hit_sum = torch.zeros(bins, dtype=torch.float64).index_add_(0, which, correct)
    return float(100.0 * (hit_sum - conf_sum).abs().sum() / n)


def reliability_bins(probs: torch.Tensor, labels: torch.Tensor, bins: int = ECE_BINS) -> list[dict]:
    """Per bin: its range, sample count, mean confidence and accuracy (None where empty): the reliability
    diagram's data."""
    confidence, predicted = probs.double().max(dim=1)
    correct = (predicted == labels.long()).double()
    which = (confidence * bins).ceil().long().clamp(1, bins) - 1
    rows = []
    for b in range(bins):
        mask = which == b
        k = int(mask.sum())
        rows.append({"low": b / bins, "high": (b + 1) / bins, "count": k,
                     "confidence": float(confidence[mask].mean()) if k else None,
                     "accuracy": float(correct[mask].mean()) if k else None})
    return rows


def selective_report(scores: torch.Tensor, correct: torch.Tensor, threshold: Optional[float]) -> dict:
    """Selective prediction: the images whose score is >= `threshold` are kept; their share (`coverage`,
    percent) and the top-1 accuracy among them (percent). No threshold keeps everything."""
    n = len(scores)
    kept = torch.ones(n, dtype=torch.bool) if threshold is None else scores >= threshold
    k = int(kept.sum())
    return {"threshold": threshold, "coverage": 100.0 * k / n if n else 0.0,
            "accuracy": 100.0 * float(correct[kept].double().sum()) / k if k else 0.0, "kept": k}
