"""infer.py's and serve.py's rows for a single-label model: `path`, `label`, `prob`, the top-k labels and
probabilities, `error`; the reject option on them (`predicted`, `score`, `unknown`); the table on stdout and
the CSV / JSON files. NumPy only: the torch path hands its logits over as NumPy, and the slim server
(serving.slim) makes its rows here too.

infer.py's and serve.py's rows for a multi-label model (NumPy only: the slim server's too): the tags whose probability reaches the class's
threshold (the thresholds tuned in training, or `--threshold X` for every class), and every class's
probability.

CSV columns: `path`, `labels` (the tags joined by the training's `data.label_delimiter`), one column per
class named by the class holding its probability, `error`. JSON rows: `path`, `labels` (a list), `probs`
(class -> probability), `error`."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Optional

import numpy as np

from imgcls.core.files import finite_or_null

UNKNOWN = "unknown"   # a rejected image's label


# --explain's CSV columns; the JSON keeps `explain` as a list instead
EXPLAIN_COLUMNS = ["explain_peak", "explain_overlay"]


def result_columns(k: int) -> list[str]:
    columns = ["path", "label", "prob"]
    for j in range(1, k + 1):
        columns += [f"top{j}_label", f"top{j}_prob"]
    return columns + ["error"]


def softmax(logits: np.ndarray, temperature: Optional[float] = None) -> np.ndarray:
    """float32 softmax over the classes of logits / temperature (the calibrated probabilities)."""
    scaled = np.asarray(logits, dtype=np.float32)
    if temperature is not None:
        scaled = scaled / np.float32(temperature)
    shifted = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def top_k(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest probabilities of each row, largest first, and their class indices (ties: lower index)."""
    order = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(probs, order, axis=1), order


def label_outputs(logits: np.ndarray, k: int, temperature: Optional[float] = None) -> dict:
    """What a row needs of a batch's logits [N, C]: the top k calibrated probabilities and their classes (so
    the memory of a pass grows with the rows, not with the classes)."""
    top_probs, top_indices = top_k(softmax(logits, temperature), k)
    return {"top_probs": top_probs, "top_indices": top_indices}


def energy_score(logits: np.ndarray) -> np.ndarray:
    """The reject score of an export (its output is the logits only): logsumexp of the logits, float32."""
    x = np.asarray(logits, dtype=np.float32)
    peak = x.max(axis=1, keepdims=True)
    return (peak + np.log(np.exp(x - peak).sum(axis=1, keepdims=True)))[:, 0]


def reject_rows(rows: list[dict], scores, threshold: float) -> int:
    """`predicted` (the would-be label) and `score` on every classified row, and `label` = unknown where the
    score is below `threshold`; returns how many were rejected."""
    rejected = 0
    for row, score in zip(rows, np.asarray(scores).tolist()):
        if row.get("error") is not None:
            continue
        row["predicted"], row["score"] = row["label"], score
        if score < threshold:
            row["label"] = UNKNOWN
            rejected += 1
    return rejected


def result_rows(paths: list[str], preds, classes: list[str]) -> list[dict]:
    """One dict per input file, in input order; unreadable files get `error` and no prediction."""
    top_probs, top_indices = preds.kept["top_probs"], preds.kept["top_indices"]
    k = top_probs.shape[1] if top_probs.ndim == 2 else 0
    probs = top_probs.tolist()
    labels = top_indices.tolist()
    valid = preds.valid.tolist()
    rows = []
    for i, path in enumerate(paths):
        row = dict.fromkeys(result_columns(k))
        row["path"] = path
        if valid[i]:
            row["label"], row["prob"] = classes[labels[i][0]], probs[i][0]
            for j in range(k):
                row[f"top{j + 1}_label"] = classes[labels[i][j]]
                row[f"top{j + 1}_prob"] = probs[i][j]
        else:
            row["error"] = preds.errors.get(i, "could not be read")
        rows.append(row)
    return rows


def table_text(text: str) -> str:
    """A name as one table cell: quoted with escapes (Python's repr) when it holds a newline, a tab or
    another unprintable character, so one row stays one line."""
    return text if text.isprintable() else repr(text)


def label_cell(row: dict) -> str:
    """The table's label: a rejected image's reads `unknown (would be X)`, so its prob (X's probability) is
    not read as a probability of `unknown`."""
    predicted = row.get("predicted")
    return f"{row['label']} (would be {predicted})" if predicted and predicted != row["label"] else row["label"]


def format_predictions_table(rows: list[dict]) -> str:
    paths = [table_text(r["path"]) for r in rows]
    width = max([len("path")] + [len(p) for p in paths])
    label_width = max([len("label")] + [len(label_cell(r)) for r in rows if r["label"] is not None])
    lines = [f"{'path':<{width}}  {'label':<{label_width}}  {'prob':>6}"]
    for path, r in zip(paths, rows):
        if r["error"] is None:
            lines.append(f"{path:<{width}}  {label_cell(r):<{label_width}}  {r['prob']:>6.4f}")
        else:
            lines.append(f"{path:<{width}}  {'-':<{label_width}}  {'-':>6}  error: {table_text(r['error'])}")
    return "\n".join(lines)


def write_rows(rows: list[dict], path: str | Path, k: int, extra: list[str] = ()) -> None:
    """`extra`: columns after the standard ones (infer_trust's); the JSON keeps `explain` as a list instead
    of the CSV's flat explain columns."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".json":
        json_rows = [{key: value for key, value in row.items() if key not in EXPLAIN_COLUMNS} for row in rows]
        path.write_text(json.dumps(finite_or_null(json_rows), indent=1, allow_nan=False) + "\n")
        return
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=result_columns(k) + list(extra), lineterminator="\n",
                                extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: "" if value is None else value for key, value in row.items()})

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
