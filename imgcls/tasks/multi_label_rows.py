"""infer.py's and serve.py's rows for a multi-label model (NumPy only: the slim server's too): the tags whose probability reaches the class's
threshold (the thresholds tuned in training, or `--threshold X` for every class), and every class's
probability.

CSV columns: `path`, `labels` (the tags joined by the training's `data.label_delimiter`), one column per
class named by the class holding its probability, `error`. JSON rows: `path`, `labels` (a list), `probs`
(class -> probability), `error`.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Optional

import numpy as np

from imgcls.core.outputs import finite_or_null
from imgcls.tasks.single_label_rows import EXPLAIN_COLUMNS

DEFAULT_THRESHOLD = 0.5   # a tag's threshold where the model records none


def applied_thresholds(recorded: Optional[list[float]], override: Optional[float], count: int) -> list[float]:
    """`--threshold` for every class, else the model's tuned thresholds, else 0.5."""
    if override is not None:
        return [override] * count
    return list(recorded) if recorded else [DEFAULT_THRESHOLD] * count


def sigmoid(logits: np.ndarray) -> np.ndarray:
    """Every class's probability, float32."""
    x = np.asarray(logits, dtype=np.float32)
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def tag_outputs(logits: np.ndarray) -> dict:
    """What a row needs of a batch's logits [N, C]: every class's probability."""
    return {"probs": sigmoid(logits)}


def tag_rows(paths: list[str], preds, classes: list[str], thresholds: list[float],
             delimiter: str) -> list[dict]:
    """One dict per input file, in input order: `labels` (a list of tags, most probable first; a tag is called
    when its probability reaches its threshold, compared in float64), `probs`."""
    all_probs = np.asarray(preds.kept["probs"])
    calls = (all_probs.astype(np.float64) >= np.asarray(thresholds, dtype=np.float64)).tolist() \
        if len(all_probs) else []
    probs = all_probs.tolist()
    valid = preds.valid.tolist()
    rows = []
    for i, path in enumerate(paths):
        row = {"path": path, "labels": None, "probs": None, "error": None}
        if valid[i]:
            tags = [c for c in range(len(classes)) if calls[i][c]]
            row["labels"] = [classes[c] for c in sorted(tags, key=lambda c: -probs[i][c])]
            row["probs"] = dict(zip(classes, probs[i]))
        else:
            row["error"] = preds.errors.get(i, "could not be read")
        rows.append(row)
    return rows


def format_tag_table(rows: list[dict], delimiter: str) -> str:
    width = max([len("path")] + [len(r["path"]) for r in rows])
    lines = [f"{'path':<{width}}  labels"]
    for r in rows:
        shown = delimiter.join(r["labels"]) if r["error"] is None else f"-  error: {r['error']}"
        lines.append(f"{r['path']:<{width}}  {shown}")
    return "\n".join(lines)


def write_tag_rows(rows: list[dict], path: str | Path, classes: list[str], delimiter: str,
                   extra: list[str] = ()) -> None:
    """`extra`: columns after `error` (eval.py's `target`, --explain's peak and overlay); the JSON keeps
    `explain` as a list instead of the CSV's flat explain columns."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".json":
        keys = ("path", "labels", "probs", "error", *(k for k in extra if k not in EXPLAIN_COLUMNS))
        doc = [{k: r.get(k) for k in keys} | ({"explain": r["explain"]} if "explain" in r else {}) for r in rows]
        path.write_text(json.dumps(finite_or_null(doc), indent=1, allow_nan=False) + "\n")
        return
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["path", "labels", *classes, "error", *extra])
        for r in rows:
            more = [r.get(k, "") for k in extra]
            if r["error"] is None:
                writer.writerow([r["path"], delimiter.join(r["labels"]), *(r["probs"][c] for c in classes), "", *more])
            else:
                writer.writerow([r["path"], "", *([""] * len(classes)), r["error"], *more])


