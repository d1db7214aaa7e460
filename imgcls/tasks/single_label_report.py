"""eval.py's report of a single-label model: the text table and the JSON document (INTERFACE keys first)."""
from __future__ import annotations

import torch

from imgcls.tasks.single_label_metrics import top5_label


def eval_document(keys: list[str], metrics: dict, per_class: dict, confusion: torch.Tensor, classes: list[str],
                  **extra) -> dict:
    """The eval JSON: the declared metrics (INTERFACE keys) first, then whatever else the caller records
    (checkpoint, split...)."""
    doc = {k: metrics[k] for k in keys}
    doc["top5_k"] = min(5, len(classes))  # top5 is top-k at k = min(5, classes)
    doc["per_class"] = per_class
    doc["confusion"] = confusion.to(torch.int64).tolist()
    doc["classes"] = list(classes)
    doc.update(extra)
    return doc


def format_eval_table(metrics: dict, per_class: dict, k: int) -> str:
    lines = [
        f"top1 {metrics['top1']:.2f}%   {top5_label(k)} {metrics['top5']:.2f}%   loss {metrics['loss']:.4f}   "
        f"mean class acc {metrics['mean_class_acc']:.2f}%   samples {metrics['num_samples']}",
        "",
    ]
    width = max([len("class")] + [len(name) for name in per_class])
    # a class's accuracy is its recall (the share of its images predicted as it): one column, named for both
    header = f"{'class':<{width}}  {'count':>6}  {'recall% (acc)':>13}  {'prec%':>6}  {'f1%':>6}"
    lines += [header, "-" * len(header)]
    for name, row in per_class.items():
        lines.append(f"{name:<{width}}  {row['count']:>6d}  {row['recall']:>13.2f}  {row['precision']:>6.2f}  "
                     f"{row['f1']:>6.2f}")
    return "\n".join(lines)
