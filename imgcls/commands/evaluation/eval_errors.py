"""eval.py's misclassified images: every validation image whose top-1 prediction is wrong, worst first (the
lowest calibrated probability given to its true class), as a CSV and a self-contained HTML gallery of
thumbnails (the audit's), written beside `--json` as <name>_errors.csv and <name>_errors.html."""
from __future__ import annotations

import csv
import html
import os
from pathlib import Path
from typing import Optional

from imgcls.auditing.html_report import MAX_SHOWN, STYLE, thumbnail_uri
from imgcls.evaluation.calibration import apply_temperature

COLUMNS = ["path", "label", "predicted", "prob_predicted", "prob_label"]


def misclassified(outputs, paths: Optional[list[str]], classes: list[str], temperature: Optional[float]) -> list[dict]:
    """Rows (COLUMNS) of the wrongly predicted samples in `outputs` (a SplitOutputs; `paths` by sample index;
    None, as for shards: "sample N"), the most confidently wrong first."""
    if not len(outputs):
        return []
    probs = apply_temperature(outputs.logits, temperature)
    predicted = probs.argmax(1)
    rows = []
    for i in (predicted != outputs.labels).nonzero().flatten().tolist():
        label, guess = int(outputs.labels[i]), int(predicted[i])
        index = int(outputs.indices[i])
        rows.append({"path": paths[index] if paths is not None else f"sample {index}", "label": classes[label],
                     "predicted": classes[guess], "prob_predicted": round(float(probs[i, guess]), 4),
                     "prob_label": round(float(probs[i, label]), 4)})
    return sorted(rows, key=lambda r: (r["prob_label"], -r["prob_predicted"], r["path"]))


def errors_paths(json_path: str | Path) -> tuple[Path, Path]:
    json_path = Path(json_path)
    return json_path.with_name(f"{json_path.stem}_errors.csv"), json_path.with_name(f"{json_path.stem}_errors.html")


def write_errors(rows: list[dict], json_path: str | Path) -> tuple[Path, Path]:
    """The CSV and the HTML gallery beside `json_path`, each written to a temp file and renamed."""
    csv_path, html_path = errors_paths(json_path)
    tmp = csv_path.with_name(f".{csv_path.name}.tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, csv_path)
    tmp = html_path.with_name(f".{html_path.name}.tmp")
    tmp.write_text(render_gallery(rows), encoding="utf-8")
    os.replace(tmp, html_path)
    return csv_path, html_path


def render_gallery(rows: list[dict]) -> str:
    figures = []
    for r in rows[:MAX_SHOWN]:
        uri = thumbnail_uri(r["path"])
        image = f'<img src="{uri}" alt="{html.escape(r["path"])}">' if uri else '<div class="bad">unreadable</div>'
        caption = (f"<b>{html.escape(r['label'])} &rarr; {html.escape(r['predicted'])}</b><br>"
                   f"p(pred) {r['prob_predicted']:.3f}, p(true) {r['prob_label']:.3f}<br>{html.escape(r['path'])}")
        figures.append(f"<figure>{image}<figcaption>{caption}</figcaption></figure>")
    more = (f'<p class="note">the first {MAX_SHOWN} of {len(rows)} shown; the CSV lists all</p>'
            if len(rows) > MAX_SHOWN else "")
    body = (f'<div class="row">{"".join(figures)}</div>' if rows else '<p class="note">no misclassified image</p>')
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>misclassified images</title>"
            f"<style>{STYLE}</style></head><body><h1>misclassified images ({len(rows)})</h1>"
            f'<p class="note">true label &rarr; prediction, the most confidently wrong first (calibrated '
            f"probabilities)</p>{more}{body}</body></html>")
