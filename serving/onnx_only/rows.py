"""serve.py's rows from an export's logits, in NumPy: the torch path's (tasks/single_label_rows.result_rows with
evaluation.evaluate.predict; tasks/multi_label_rows.tag_rows; prediction.trust.apply_reject)
in the same float32 arithmetic, so labels agree and probabilities agree to float32 rounding."""
from __future__ import annotations

from typing import Optional

import numpy as np

UNKNOWN = "unknown"   # a rejected image's label (prediction.trust.UNKNOWN)


def softmax(logits: np.ndarray, temperature: Optional[float] = None) -> np.ndarray:
    """float32 softmax over the classes of logits / temperature (the calibrated probabilities)."""
    scaled = logits.astype(np.float32)
    if temperature is not None:
        scaled = scaled / np.float32(temperature)
    shifted = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def top_k(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest probabilities of each row, largest first, and their class indices (ties: lower index)."""
    order = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(probs, order, axis=1), order


def energy(logits: np.ndarray) -> np.ndarray:
    """The energy reject score: logsumexp of the logits (evaluation.rejection.energy_score)."""
    x = logits.astype(np.float32)
    peak = x.max(axis=1, keepdims=True)
    return (peak + np.log(np.exp(x - peak).sum(axis=1, keepdims=True)))[:, 0]


def sigmoid(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float32)
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def label_rows(names: list[Optional[str]], logits: np.ndarray, classes: list[str], k: int,
               temperature: Optional[float]) -> list[dict]:
    """One row per image: `label`, `prob` (calibrated), `top{j}_label`, `top{j}_prob`, `error` (None)."""
    probs, indices = top_k(softmax(logits, temperature), k)
    rows = []
    for name, row_probs, row_indices in zip(names, probs.tolist(), indices.tolist()):
        row = {"path": name, "label": classes[row_indices[0]], "prob": row_probs[0]}
        for j in range(k):
            row[f"top{j + 1}_label"] = classes[row_indices[j]]
            row[f"top{j + 1}_prob"] = row_probs[j]
        row["error"] = None
        rows.append(row)
    return rows


def reject(rows: list[dict], scores: np.ndarray, threshold: float) -> None:
    """`predicted` (the would-be label) and `score` on every row; `label` unknown below `threshold`."""
    for row, score in zip(rows, scores.tolist()):
        row["predicted"], row["score"] = row["label"], score
        if score < threshold:
            row["label"] = UNKNOWN


def tag_rows(names: list[Optional[str]], logits: np.ndarray, classes: list[str],
             thresholds: list[float]) -> list[dict]:
    """Multi-label rows: `labels` (the tags at or above their threshold, most probable first), `probs`."""
    probs = sigmoid(logits)
    calls = probs.astype(np.float64) >= np.asarray(thresholds, dtype=np.float64)
    rows = []
    for name, row_probs, row_calls in zip(names, probs.tolist(), calls.tolist()):
        tags = [c for c in range(len(classes)) if row_calls[c]]
        rows.append({"path": name, "labels": [classes[c] for c in sorted(tags, key=lambda c: -row_probs[c])],
                     "probs": dict(zip(classes, row_probs)), "error": None})
    return rows
