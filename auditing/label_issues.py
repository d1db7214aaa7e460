"""Likely label errors from out-of-sample probabilities, by cleanlab (confident learning).

Single-label: `cleanlab.filter.find_label_issues` decides which images are issues; they are ranked by
self-confidence (the probability the model gives the label the image has: lowest first) and each gets the
class the model prefers. The rows are labelled-sample records so that a multi-label audit (labels as sets,
cleanlab's `multi_label=True` with one-hot label lists) can produce the same record shape.
"""
from __future__ import annotations

import numpy as np


def find_label_issues(labels: list[int], probs: np.ndarray) -> list[dict]:
    """[{"position", "given", "suggested", "score"}] for the images cleanlab flags, most likely error first.
    `score` is the self-confidence: the out-of-sample probability of the given label."""
    from cleanlab.filter import find_label_issues as cleanlab_find

    labels_arr = np.asarray(labels, dtype=np.int64)
    if len(labels_arr) == 0:
        return []
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / np.clip(probs.sum(axis=1, keepdims=True), 1e-12, None)
    flagged = cleanlab_find(labels_arr, probs, filter_by="prune_by_noise_rate",
                            return_indices_ranked_by="self_confidence")
    return [{"position": int(i), "given": int(labels_arr[i]), "suggested": int(probs[i].argmax()),
             "score": float(probs[i, labels_arr[i]])} for i in flagged]
