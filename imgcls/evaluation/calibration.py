"""Calibrated probabilities: temperature scaling (Guo et al., 2017), expected calibration error, NLL and
selective-prediction figures, as pure functions of logits and labels (infer.py, eval.py, a server and the
post-training fit all call these).

Temperature scaling divides the logits by one number T > 0 before the softmax, so the argmax never
changes; T is fitted on the validation split's logits by minimising the NLL under a prior on log T, and
applied only when it lowers the expected calibration error of held-out folds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from imgcls.core.settings import MAX_TEMPERATURE, MIN_TEMPERATURE

ECE_BINS = 15
# the fitted temperature stays within core.settings's bounds (log-space search); a split too small or too
# easy to pin it down (every sample right with any confidence) ends at a bound rather than at 0 or infinity
# below this many validation images the fitted temperature is reported as uncertain
MIN_CALIBRATION_SAMPLES = 100
# a sharpening (T < 1) that rests on fewer validation errors than this is said: the prior on T decides it
MIN_CALIBRATION_ERRORS = 5
# the MAP fit's normal prior on log T (centred on T = 1); a fitted T is applied only when the ECE of the folds it
# was not fitted on falls (cross-fitting over this many folds of the validation split)
PRIOR_SD = 0.5
CALIBRATION_FOLDS = 5
# the held-out ECE must fall by at least this share of the plain softmax's: a 3-epoch photos model's 70-image
# split gained 4% held out (11.11% -> 10.67%) with a T that took its test ECE from 10.20% to 15.05%; the fits
# that helped on test gained 34-76% (docs/advice.md)
MIN_ECE_GAIN = 0.10


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


def nll_slopes(logits: torch.Tensor, labels: torch.Tensor, log_t: float) -> tuple[float, float]:
    """The first and second derivatives in u = log T of the mean NLL of softmax(logits / T), in closed form:
    with s = logits / T and p its softmax, dNLL/du = mean(s_y - E_p[s]) and d2NLL/du2 = mean(Var_p(s) +
    E_p[s] - s_y) (ds/du = -s; dp_j/du = p_j (E_p[s] - s_j))."""
    s = logits * math.exp(-log_t)
    p = s.softmax(dim=1)
    mean_s = (p * s).sum(dim=1)
    var_s = (p * s * s).sum(dim=1) - mean_s ** 2
    s_y = s.gather(1, labels[:, None]).squeeze(1)
    return float((s_y - mean_s).mean()), float((var_s + mean_s - s_y).mean())


def rising_root(slopes, low: float, high: float) -> float:
    """The u in [low, high] where a rising function of u (`slopes(u)` gives its value and derivative) crosses
    0: Newton steps kept inside a bracket whose ends have the value below and above 0, a bisection step
    whenever Newton would leave it or the derivative is not positive. `low` or `high` when it does not cross."""
    if slopes(low)[0] >= 0:
        return low
    if slopes(high)[0] <= 0:
        return high
    u = min(max(0.0, low), high)
    for _ in range(100):
        value, derivative = slopes(u)
        if value == 0:
            return u
        if value < 0:
            low = u
        else:
            high = u
        step = u - value / derivative if derivative > 0 else math.nan
        following = step if low <= step <= high else (low + high) / 2
        if abs(following - u) < 1e-12 or high - low < 1e-12:
            return following
        u = following
    return u


def temperature_of(log_t: float) -> float:
    """T from log T, exactly at a bound when the search stopped there."""
    if log_t <= math.log(MIN_TEMPERATURE):
        return MIN_TEMPERATURE
    if log_t >= math.log(MAX_TEMPERATURE):
        return MAX_TEMPERATURE
    return min(max(math.exp(log_t), MIN_TEMPERATURE), MAX_TEMPERATURE)


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor, prior_sd: Optional[float] = None) -> float:
    """The T that minimises the NLL of softmax(logits / T), in float64 without autograd: the zero of the
    closed-form slope in u = log T (`nll_slopes`, by `rising_root`) within [MIN_TEMPERATURE, MAX_TEMPERATURE];
    the NLL is convex in 1 / T, so its slope in log T changes sign once. 1.0 with no samples. T is one scalar:
    the LBFGS with autograd this replaced took most of the post-training fit's time, for the same optimum
    (issue 47).
    `prior_sd`: a normal prior on log T around 0 (T = 1) with this spread, added to the summed NLL (a MAP
    fit): with few errors the NLL alone runs to T -> 0, the prior holds it where the data stops pulling."""
    n = len(labels)
    if n == 0:
        return 1.0
    logits, labels = logits.detach().double(), labels.long()
    if not bool(torch.isfinite(logits).all()):  # NaN logits the NLL cannot fit: the plain softmax
        return 1.0
    pull = 0.0 if prior_sd is None else 1.0 / (prior_sd ** 2 * n)   # the prior's slope per unit of log T

    def slopes(u: float) -> tuple[float, float]:
        first, second = nll_slopes(logits, labels, u)
        return first + pull * u, second + pull
    u = rising_root(slopes, math.log(MIN_TEMPERATURE), math.log(MAX_TEMPERATURE))
    return temperature_of(u)


def confidence_slopes(logits: torch.Tensor, log_t: float) -> tuple[float, float]:
    """The mean top-1 probability of softmax(logits / T) and its derivative in u = log T (the argmax does not
    move with T: dp_k/du = p_k (E_p[s] - s_k), s = logits / T)."""
    s = logits * math.exp(-log_t)
    p = s.softmax(dim=1)
    top = s.argmax(dim=1, keepdim=True)
    p_top, s_top = p.gather(1, top).squeeze(1), s.gather(1, top).squeeze(1)
    return float(p_top.mean()), float((p_top * ((p * s).sum(dim=1) - s_top)).mean())


def counted_accuracy(right: int, n: int, count: str = "jeffreys") -> float:
    """The accuracy a confidence match aims at. `plain`: right / n, once the split has MIN_CALIBRATION_ERRORS
    errors (with fewer, one error more or less moves it by a whole step: the `jeffreys` count instead).
    `jeffreys`: the posterior mean under a Beta(a, a) prior on the accuracy, (right + a) / (n + 2a), with
    Jeffreys's a = 1/2 on a split without errors (a confidence below 1: no T -> 0) weighted down as errors
    accumulate, a = 1/2 / (1 + errors): the prior speaks where the errors cannot, and steps aside once they
    can. Laplace's (right + 1) / (n + 2) pulled a 98%-accurate label-smoothed model's target 0.5 points
    towards 1/2, which left its test split 3.4% under-confident (docs/advice.md)."""
    wrong = n - right
    if count == "plain" and wrong >= MIN_CALIBRATION_ERRORS:
        return right / n
    prior = 0.5 / (1 + wrong)
    return (right + prior) / (n + 2 * prior)


def match_temperature(logits: torch.Tensor, labels: torch.Tensor, count: str = "jeffreys") -> float:
    """The T at which the mean top-1 confidence equals the accuracy (`counted_accuracy`, `count`: `jeffreys` or
    `plain`): the root in log T (the top-1 probability falls as T grows, `rising_root`), within
    [MIN_TEMPERATURE, MAX_TEMPERATURE]. 1.0 with no samples."""
    n = len(labels)
    if n == 0:
        return 1.0
    logits = logits.detach().double()
    if not bool(torch.isfinite(logits).all()):
        return 1.0
    target = counted_accuracy(int((logits.argmax(1) == labels.long()).sum()), n, count)

    def slopes(u: float) -> tuple[float, float]:
        confidence, derivative = confidence_slopes(logits, u)
        return target - confidence, -derivative
    u = rising_root(slopes, math.log(MIN_TEMPERATURE), math.log(MAX_TEMPERATURE))
    return temperature_of(u)


def plain_match_temperature(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The confidence match to the plain accuracy (Jeffreys's under MIN_CALIBRATION_ERRORS errors)."""
    return match_temperature(logits, labels, count="plain")


def map_temperature(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The NLL fit with the prior on log T (`PRIOR_SD`)."""
    return fit_temperature(logits, labels, prior_sd=PRIOR_SD)


# the fits `calibrated_temperature` chooses between by their held-out ECE (the first of equals); each is sound on
# a split with few or no errors: the prior on T, Jeffreys's count
TEMPERATURE_FITS = {"NLL with a prior on T": map_temperature,
                    "mean confidence = accuracy, Jeffreys prior": match_temperature,
                    "mean confidence = accuracy": plain_match_temperature}


def fold_of(n: int, folds: int = CALIBRATION_FOLDS) -> torch.Tensor:
    """Each validation image's fold (0 .. folds - 1): a fixed permutation, so a separate pass over the same
    outputs assigns the same folds."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(0)) % folds


def held_out_probs(logits: torch.Tensor, labels: torch.Tensor, folds: int = CALIBRATION_FOLDS,
                   fit=map_temperature) -> torch.Tensor:
    """Each image's probabilities under the temperature `fit` gives on the other folds only."""
    which = fold_of(len(labels), folds)
    probs = torch.empty(logits.shape, dtype=torch.float32)
    for k in range(folds):
        test = which == k
        t = fit(logits[~test], labels[~test])
        probs[test] = apply_temperature(logits[test], t)
    return probs


@dataclass
class TemperatureFit:
    """The temperature to use, the fit's own value, whether it was applied, and why (`decision`: one sentence
    for the log); `notes`: what limited it (plain sentences for the log's warnings and eval.py)."""

    temperature: float
    fitted: float
    errors: int
    notes: list[str] = field(default_factory=list)
    decision: str = ""


def calibrated_temperature(logits: torch.Tensor, labels: torch.Tensor) -> TemperatureFit:
    """Of the TEMPERATURE_FITS (the NLL with a normal prior on log T; the mean confidence matched to the
    accuracy under a Jeffreys prior weighted by the errors, and to the plain accuracy from
    MIN_CALIBRATION_ERRORS errors), the one whose temperatures give the lowest ECE on held-out data (each of
    CALIBRATION_FOLDS folds scored with the T fitted on the others); its T on the whole split is applied only
    when that held-out ECE is at least MIN_ECE_GAIN lower than the plain softmax's and the whole split's ECE is
    not higher, else T stays 1 and a note says so.
    No fit runs to T -> 0 on a split with few or no errors (the prior on T; Jeffreys's count), so
    an under-confident model with 2% errors is still sharpened; a fit at a bound, a split under
    MIN_CALIBRATION_SAMPLES images and a sharpening on fewer than MIN_CALIBRATION_ERRORS errors are said in
    `notes`."""
    n = len(labels)
    errors = int((logits.argmax(1) != labels.long()).sum()) if n else 0
    notes = []
    if n and n < MIN_CALIBRATION_SAMPLES:
        notes.append(f"only {n} validation images (under {MIN_CALIBRATION_SAMPLES}): the temperature is uncertain")
    if n < 2 * CALIBRATION_FOLDS:
        fitted = map_temperature(logits, labels)
        return TemperatureFit(1.0, fitted, errors, notes + [f"only {n} validation images: no held-out check "
                                                            f"possible, the temperature is kept at 1.0"],
                              "kept at 1.0 (too few images to check a fit)")
    plain = expected_calibration_error(apply_temperature(logits, None), labels)
    held = {name: expected_calibration_error(held_out_probs(logits, labels, fit=fit), labels)
            for name, fit in TEMPERATURE_FITS.items()}
    method = min(held, key=held.get)
    fitted = TEMPERATURE_FITS[method](logits, labels)
    if fitted <= MIN_TEMPERATURE * (1 + 1e-6) or fitted >= MAX_TEMPERATURE * (1 - 1e-6):
        bound = "lower" if fitted < 1 else "upper"
        notes.append(f"the fit ended at its {bound} bound ({fitted:g}): the validation split cannot pin the "
                     f"temperature down")
    whole = expected_calibration_error(apply_temperature(logits, fitted), labels)
    figures = (f"held-out ECE {plain:.2f}% -> {held[method]:.2f}% ({CALIBRATION_FOLDS}-fold), whole split "
               f"{plain:.2f}% -> {whole:.2f}%")
    if held[method] <= (1 - MIN_ECE_GAIN) * plain and whole <= plain:
        if fitted < 1.0 and errors < MIN_CALIBRATION_ERRORS:
            notes.append(f"the validation split has {errors} error(s) (under {MIN_CALIBRATION_ERRORS}): the "
                         f"sharpening to T = {fitted:.4g} rests on few errors")
        return TemperatureFit(fitted, fitted, errors, notes, f"applied T = {fitted:.4g} ({method}): {figures}")
    decision = (f"declined T = {fitted:.4g} ({method}), kept 1.0: it would not lower the ECE by "
                f"{100 * MIN_ECE_GAIN:.0f}% held out and at all on the whole split ({figures})")
    return TemperatureFit(1.0, fitted, errors, notes + [decision], decision)


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
