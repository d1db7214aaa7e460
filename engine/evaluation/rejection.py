"""The reject option: a score per image that is high for images like the training data and low for
others, and the threshold below which an image is labelled `unknown`. Pure functions of logits and
penultimate features, so infer.py, eval.py and a server share them.

Scores (higher: more in-distribution):
- msp: the largest (calibrated) softmax probability (the baseline);
- energy: logsumexp of the logits (Liu et al., 2020), computable from any export's output;
- knn: minus the distance from the L2-normalised penultimate feature to its k-th nearest neighbour in a
  bank of normalised training features (Sun et al., 2022);
- mahalanobis: minus the smallest Mahalanobis distance to a class mean under the shared covariance of
  the training features (Lee et al., 2018).
The threshold is the score that keeps `coverage` of the validation split. Checkpoints reject by
mahalanobis, which rejected the most out-of-distribution images at equal coverage on held-out digits
(python -m benchmarking.trust); exports by energy, computed from the logits that are their only output.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

METHODS = ("msp", "energy", "knn", "mahalanobis")
FEATURE_METHODS = ("knn", "mahalanobis")
# the method the checkpoint's reject option uses: of the four, it rejected the most foreign images at the same
# coverage of validation images (python -m benchmarking.trust)
DEFAULT_METHOD = "mahalanobis"
# what an exported model's reject option uses: its output is the logits only
LOGITS_METHOD = "energy"
KNN_K = 1
BANK_SIZE = 2048   # training features used (and kept in the checkpoint, fp16: 2048 x 512 is 2 MB)


def classifier_name(model: torch.nn.Module) -> Optional[str]:
    """The qualified name of a timm model's classifier (`get_classifier()`), None for a model without one
    with weights (torchvision models, exports)."""
    head = model.get_classifier() if hasattr(model, "get_classifier") else None
    if not isinstance(head, torch.nn.Module) or not any(True for _ in head.parameters()):
        return None
    return next((name for name, m in model.named_modules() if m is head), None)


class FeatureTap:
    """Records the input of a timm model's classifier on every forward: the pooled penultimate features,
    caught without changing how the model is called (compiled, or BatchNorm-folded by torch.fx, which keeps
    the submodule names: pass `head_name` found on the model before folding). `available` is False for a
    model without a classifier module."""

    def __init__(self, model: torch.nn.Module, head_name: Optional[str] = None):
        self.features: Optional[torch.Tensor] = None
        name = head_name or classifier_name(model)
        head = None
        if name:
            try:
                head = model.get_submodule(name)
            except AttributeError:
                head = None
        self.available = head is not None
        self._handle = head.register_forward_hook(self._record) if self.available else None

    def _record(self, module, inputs, output) -> None:
        if self.features is None:  # the first forward since the last take (with TTA: the unflipped image)
            self.features = inputs[0].detach().flatten(1)

    def take(self) -> Optional[torch.Tensor]:
        """The features of the last forward (then forgotten)."""
        features, self.features = self.features, None
        return features

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def threshold_for_coverage(scores: torch.Tensor, coverage: float) -> float:
    """A threshold t such that at least `coverage` of `scores` are >= t: midway between the lowest score
    kept and the next one down, so rounding differences between passes (batch size, memory layout) do not
    move a sample across it."""
    if len(scores) == 0:
        return -math.inf
    ordered = scores.double().sort(descending=True).values
    keep = min(len(ordered), max(1, math.ceil(coverage * len(ordered) - 1e-9)))
    if keep == len(ordered):
        lowest = float(ordered[-1])
        return lowest - max(1e-6, 1e-3 * abs(lowest))
    return float((ordered[keep - 1] + ordered[keep]) / 2)


def msp_score(logits: torch.Tensor, temperature: Optional[float] = None) -> torch.Tensor:
    scaled = logits.float() / (temperature or 1.0)
    return scaled.softmax(dim=1).max(dim=1).values


def energy_score(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits.float(), dim=1)


def normalise(features: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(features.float(), dim=1)


def knn_score(features: torch.Tensor, bank: torch.Tensor, k: int = KNN_K) -> torch.Tensor:
    """Minus the Euclidean distance between normalised vectors to the k-th nearest bank vector."""
    similarity = normalise(features) @ normalise(bank).T
    kth = similarity.topk(min(k, bank.shape[0]), dim=1).values[:, -1]
    return -(2.0 - 2.0 * kth).clamp(min=0).sqrt()


def mahalanobis_fit(features: torch.Tensor, labels: torch.Tensor,
                    num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Class means [C, D] and the precision matrix [D, D] of the shared (tied) covariance, in float64,
    regularised by a small ridge so it inverts when features outnumber samples."""
    x = features.double()
    means = torch.zeros(num_classes, x.shape[1], dtype=torch.float64)
    means.index_add_(0, labels, x)
    counts = torch.bincount(labels, minlength=num_classes).clamp(min=1).double()
    means /= counts[:, None]
    centred = x - means[labels]
    covariance = centred.T @ centred / max(len(x), 1)
    ridge = 1e-3 * covariance.diagonal().mean().clamp(min=1e-12)
    precision = torch.linalg.inv(covariance + ridge * torch.eye(x.shape[1], dtype=torch.float64))
    return means.float(), precision.float()


def mahalanobis_score(features: torch.Tensor, means: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    diff = features.double()[:, None, :] - means.double()[None]               # [N, C, D]
    distance = torch.einsum("ncd,de,nce->nc", diff, precision.double(), diff)
    return -distance.min(dim=1).values.float()


def seeded_subset(n: int, size: int, seed: int) -> list[int]:
    """`size` of range(n) (all when n <= size), drawn by `seed`, in ascending order."""
    if n <= size:
        return list(range(n))
    generator = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(n, generator=generator)[:size].tolist())


class Rejector:
    """The stored reject record (`calibration` in best.pt) as a scorer: `scores(logits, features)`,
    `rejected(scores)`. `threshold` may be replaced by hand (`--reject-below`)."""

    def __init__(self, method: str, threshold: float, temperature: Optional[float] = None,
                 bank: Optional[torch.Tensor] = None, k: int = KNN_K, means: Optional[torch.Tensor] = None,
                 precision: Optional[torch.Tensor] = None):
        if method not in METHODS:
            raise ValueError(f"unknown reject method {method!r}; one of {METHODS}")
        self.method, self.threshold, self.temperature = method, float(threshold), temperature
        self.bank = bank.float() if bank is not None else None
        self.k, self.means, self.precision = k, means, precision

    @property
    def needs_features(self) -> bool:
        return self.method in FEATURE_METHODS

    def scores(self, logits: torch.Tensor, features: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.method == "msp":
            return msp_score(logits, self.temperature)
        if self.method == "energy":
            return energy_score(logits)
        if features is None:
            raise ValueError(f"the {self.method} score needs penultimate features")
        if self.method == "knn":
            return knn_score(features, self.bank.to(features.device), self.k)
        return mahalanobis_score(features, self.means.to(features.device), self.precision.to(features.device))

    def rejected(self, scores: torch.Tensor) -> torch.Tensor:
        return scores < self.threshold


def rejector_from_record(record: dict, method: Optional[str] = None) -> Rejector:
    """A Rejector from a checkpoint's / export's `calibration` record, for `method` (default: the record's)."""
    method = method or record["method"]
    return Rejector(method, record["thresholds"][method], record.get("temperature"),
                    bank=record.get("feature_bank"), k=int(record.get("knn_k", KNN_K)),
                    means=record.get("class_means"), precision=record.get("precision"))
