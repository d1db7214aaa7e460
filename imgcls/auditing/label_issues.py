"""Likely label errors from out-of-sample probabilities: cleanlab's confident learning, and the images the
out-of-fold model confidently files under another class.

Single-label: `cleanlab.filter.find_label_issues` (prune_by_noise_rate) counts an image towards another class
only when that class's probability reaches the class's mean self-confidence. The audit's fold models train
for few epochs and are under-confident, so a planted error the fold model put in the right class at 0.58 was
missed where that class's own images averaged 0.63 (and a user's cat filed under `coffee`). An image whose
out-of-fold prediction is another class at DISAGREEMENT_RATIO times the probability of its given label is
flagged too. Issues are ranked by self-confidence (the probability the model gives the label the image has:
lowest first) and each gets the class the model prefers; `rule` says which test flagged it. The rows are
labelled-sample records so that a multi-label audit can produce the same record shape.
"""
from __future__ import annotations

import numpy as np

DISAGREEMENT_RATIO = 2.0   # argmax probability over the given label's probability that flags a disagreement


def find_label_issues(labels: list[int], probs: np.ndarray) -> list[dict]:
    """[{"position", "given", "suggested", "score", "rule"}] for the images flagged, most likely error first.
    `score` is the self-confidence: the out-of-sample probability of the given label; `rule` is
    `confident_learning` (cleanlab) or `disagreement` (predicted another class at DISAGREEMENT_RATIO x)."""
    from cleanlab.filter import find_label_issues as cleanlab_find

    labels_arr = np.asarray(labels, dtype=np.int64)
    if len(labels_arr) == 0:
        return []
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / np.clip(probs.sum(axis=1, keepdims=True), 1e-12, None)
    flagged = set(int(i) for i in cleanlab_find(labels_arr, probs, filter_by="prune_by_noise_rate"))
    rows = np.arange(len(labels_arr))
    given_p = probs[rows, labels_arr]
    predicted = probs.argmax(axis=1)
    disagree = (predicted != labels_arr) & (probs[rows, predicted] >= DISAGREEMENT_RATIO * given_p)
    positions = sorted(flagged | set(int(i) for i in np.flatnonzero(disagree)), key=lambda i: (given_p[i], i))
    return [{"position": i, "given": int(labels_arr[i]), "suggested": int(predicted[i]), "score": float(given_p[i]),
             "rule": "confident_learning" if i in flagged else "disagreement"} for i in positions]
