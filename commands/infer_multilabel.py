"""infer.py's rows for a multi-label model (`data.task: multilabel`): the tags whose probability reaches
the class's threshold (the thresholds tuned in training, or `--threshold X` for every class), and every
class's probability.

CSV columns: `path`, `labels` (the tags joined by the training's `data.label_delimiter`), one column per
class named by the class holding its probability, `error`. JSON rows: `path`, `labels` (a list), `probs`
(class -> probability), `error`.
"""
from __future__ import annotations

import csv
import json
import logging
import sys
from pathlib import Path
from typing import Optional

from core.errors import ConfigError
from core.outputs import finite_or_null
from engine.evaluation.evaluate import TagPredictions, check_finite_outputs, predict_tags
from engine.evaluation.multilabel import DEFAULT_THRESHOLD, predicted

log = logging.getLogger("infer")


def applied_thresholds(recorded: Optional[list[float]], override: Optional[float], count: int) -> list[float]:
    """`--threshold` for every class, else the model's tuned thresholds, else 0.5."""
    if override is not None:
        return [override] * count
    return list(recorded) if recorded else [DEFAULT_THRESHOLD] * count


def check_threshold_flag(threshold: Optional[float], multilabel: bool) -> None:
    if threshold is None:
        return
    if not multilabel:
        raise ConfigError(f"--threshold {threshold}: applies to a multi-label model (data.task=multilabel); this "
                          f"model gives one label per image")
    if not 0.0 <= threshold <= 1.0:
        raise ConfigError(f"--threshold {threshold}: must be a probability in [0, 1]")


def check_single_label_flags(multilabel: bool, **flags) -> None:
    """ConfigError (exit 2) for a single-label option given with a multi-label model (it was ignored)."""
    given = [name for name, value in flags.items() if value is not None]
    if multilabel and given:
        raise ConfigError(f"{', '.join(given)}: calibration, the reliability diagram and the reject option are "
                          f"single-label; this model is multi-label (each tag is called at its threshold)")


def tag_rows(paths: list[str], preds: TagPredictions, classes: list[str], thresholds: list[float],
             delimiter: str) -> list[dict]:
    """One dict per input file, in input order: `labels` (a list of tags, most probable first), `probs`."""
    calls = predicted(preds.probs, thresholds).tolist() if len(preds.probs) else []
    probs = preds.probs.tolist()
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


def write_tag_rows(rows: list[dict], path: str | Path, classes: list[str], delimiter: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".json":
        doc = [{k: r[k] for k in ("path", "labels", "probs", "error", "explain") if k in r} for r in rows]
        path.write_text(json.dumps(finite_or_null(doc), indent=1, allow_nan=False) + "\n")
        return
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        explained = any("explain_peak" in r for r in rows)
        writer.writerow(["path", "labels", *classes, "error"] + (["explain_peak", "explain_overlay"] if explained
                                                                 else []))
        for r in rows:
            extra = [r.get("explain_peak", ""), r.get("explain_overlay", "")] if explained else []
            if r["error"] is None:
                writer.writerow([r["path"], delimiter.join(r["labels"]), *(r["probs"][c] for c in classes), ""]
                                + extra)
            else:
                writer.writerow([r["path"], "", *([""] * len(classes)), r["error"]] + extra)


def run_tag_inference(paths: list[str], model, loader, device_input, loaded, threshold: Optional[float],
                      output: Optional[str], explain_dir: Optional[str] = None) -> int:
    """infer.py's work after the model and loader are built, for a multi-label model; the exit status.
    `explain_dir`: a Grad-CAM overlay per called tag of each image (commands.infer_trust.explain_rows)."""
    classes, delimiter = loaded.classes, loaded.cfg.data.label_delimiter
    thresholds = applied_thresholds(loaded.thresholds, threshold, len(classes))
    source = (f"--threshold {threshold}" if threshold is not None else
              "the per-class thresholds tuned in training" if loaded.thresholds else "0.5 (the model records none)")
    print(f"multi-label: a tag is called at {source}", file=sys.stderr)
    preds = predict_tags(model, loader, device_input, len(classes))
    check_finite_outputs(preds.nonfinite, int(preds.valid.sum()), loaded.path)
    rows = tag_rows(paths, preds, classes, thresholds, delimiter)
    if explain_dir:
        from commands.infer_trust import explain_rows

        explain_rows(loaded, paths, rows, classes, explain_dir, wanted=lambda row: row["labels"])
        print(f"wrote Grad-CAM overlays (one per called tag) to {explain_dir}", file=sys.stderr)
    print(format_tag_table(rows, delimiter))
    failed = [r for r in rows if r["error"] is not None]
    for r in failed:
        log.warning("could not read %s: %s", r["path"], r["error"])
    if output:
        write_tag_rows(rows, output, classes, delimiter)
    classified = len(rows) - len(failed)
    print(f"classified {classified} of {len(rows)} file(s)" + (f"; {len(failed)} could not be read" if failed else "")
          + (f"; wrote {output}" if output else ""), file=sys.stderr)
    return 0 if classified else 1
