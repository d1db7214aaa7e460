"""eval.py's report of a multi-label model: the text table and the JSON document."""
from __future__ import annotations


def multilabel_document(keys: list[str], metrics: dict, per_class: dict, classes: list[str], **extra) -> dict:
    """The eval JSON of a multi-label model: mAP, F1 / precision / recall at the model's thresholds and at
    0.5, `per_class` (name -> ap, f1, precision, recall, threshold, positives), then the caller's extras."""
    doc = {k: metrics[k] for k in keys}
    doc["per_class"] = per_class
    doc["classes"] = list(classes)
    doc.update(extra)
    return doc


def format_multilabel_table(metrics: dict, per_class: dict) -> str:
    m = metrics
    mean_ap = "undefined (no tag in the split)" if m["mAP"] is None else f"{m['mAP']:.2f}%"
    lines = [f"mAP {mean_ap}   micro F1 {m['micro_f1']:.2f}%   macro F1 {m['macro_f1']:.2f}%   precision "
             f"{m['precision']:.2f}%   recall {m['recall']:.2f}%   loss {m['loss']:.4f}   samples {m['num_samples']}",
             f"at threshold 0.5: micro F1 {m['micro_f1_at_0.5']:.2f}%   macro F1 {m['macro_f1_at_0.5']:.2f}%   "
             f"precision {m['precision_at_0.5']:.2f}%   recall {m['recall_at_0.5']:.2f}%", ""]
    width = max([len("class")] + [len(name) for name in per_class])
    header = f"{'class':<{width}}  {'positives':>9}  {'ap%':>6}  {'f1%':>6}  {'prec%':>6}  {'recall%':>7}  {'threshold':>9}"
    lines += [header, "-" * len(header)]
    for name, row in per_class.items():
        ap = "-" if row["ap"] is None else f"{row['ap']:.2f}"
        lines.append(f"{name:<{width}}  {row['positives']:>9d}  {ap:>6}  {row['f1']:>6.2f}  {row['precision']:>6.2f}  "
                     f"{row['recall']:>7.2f}  {row['threshold']:>9.4f}")
    return "\n".join(lines)
