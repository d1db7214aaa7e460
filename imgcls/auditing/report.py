"""Balance and shape: images per class per split, the imbalance ratio, classes below a minimum, the image
sizes, aspect ratios, modes and formats, the outliers among them, and the advice that follows.

The audit as one self-contained HTML file: flagged images as thumbnails side by side (leak pairs,
duplicate groups, label issues with their given and suggested class), embedded as base64 data URIs, so
the page needs nothing but itself (no scripts, no external assets)."""
from __future__ import annotations

import base64
import html
import io
from collections import Counter

import numpy as np

from imgcls.auditing.outliers import outliers_section
from imgcls.data.images import ImageDecodeError, load_rgb

IMBALANCE_ADVICE_RATIO = 3.0   # max/min training class size from which the weighted sampler is advised


EXTREME_ASPECT = 4.0           # width/height beyond 4:1 (or 1:4): a random crop sees mostly one strip


SMALL_FACTOR = 0.5             # shorter side below half of data.img_size: upscaled more than 2x


PHASH_SIDE = 32                # pHash reads a 32x32 grayscale: smaller images hash too coarsely for near matches


def class_counts(splits: dict[str, list[int]], classes: list[str]) -> dict[str, dict[str, int]]:
    """split -> class name -> images (every class listed, zeros included)."""
    def counts(labels) -> np.ndarray:
        if labels and isinstance(labels[0], tuple):  # multi-label: each image counts once in each of its tags
            labels = [c for tags in labels for c in tags]
        return np.bincount(np.asarray(labels, dtype=np.int64), minlength=len(classes))

    return {split: {name: int(n) for name, n in zip(classes, counts(labels))} for split, labels in splits.items()}


def balance(train_counts: dict[str, int], min_images: int) -> dict:
    counts = list(train_counts.values())
    smallest, largest = min(counts), max(counts)
    return {"imbalance_ratio": (largest / smallest) if smallest else None,
            "largest_class": max(train_counts, key=train_counts.get),
            "smallest_class": min(train_counts, key=train_counts.get),
            "min_class_images": min_images,
            "small_classes": sorted(name for name, n in train_counts.items() if n < min_images)}


def _summary(values: list[float]) -> dict:
    if not values:
        return {}
    arr = np.asarray(values, dtype=np.float64)
    return {"min": float(arr.min()), "median": float(np.median(arr)), "max": float(arr.max())}


def image_stats(sizes: list[tuple[int, int]], modes: list[str], formats: list[str], names: list[str],
                img_size: int) -> dict:
    """Width / height / aspect summaries, counts of modes and formats, and outliers: images whose shorter
    side is below half of `img_size` (upscaled over 2x), or whose aspect ratio is beyond 4:1."""
    widths = [w for w, _ in sizes]
    heights = [h for _, h in sizes]
    aspects = [w / h for w, h in sizes if h]
    small = [n for n, (w, h) in zip(names, sizes) if min(w, h) < SMALL_FACTOR * img_size]
    extreme = [n for n, (w, h) in zip(names, sizes) if h and not 1 / EXTREME_ASPECT <= w / h <= EXTREME_ASPECT]
    return {"count": len(sizes), "width": _summary(widths), "height": _summary(heights), "aspect": _summary(aspects),
            "modes": dict(Counter(modes).most_common()), "formats": dict(Counter(formats).most_common()),
            "outliers": {"small": small, "extreme_aspect": extreme}}


def advice(bal: dict, stats: dict, img_size: int) -> list[str]:
    """What to do about the balance and shape findings."""
    out = []
    ratio = bal["imbalance_ratio"]
    if ratio is None or ratio >= IMBALANCE_ADVICE_RATIO:
        shown = "a class has no training image" if ratio is None else f"imbalance ratio {ratio:.1f}"
        out.append(f"{shown} ({bal['largest_class']} vs {bal['smallest_class']}): train with "
                   f"data.sampler=weighted, and judge the run by mean_class_acc and the per-class accuracy of "
                   f"eval.py, not top-1 alone")
    if bal["small_classes"]:
        out.append(f"{len(bal['small_classes'])} class(es) have fewer than {bal['min_class_images']} training "
                   f"images ({', '.join(bal['small_classes'][:10])}): collect more, or merge them")
    small = stats["outliers"]["small"]
    if small:
        out.append(f"{len(small)} image(s) have a shorter side below {int(SMALL_FACTOR * img_size)} px and are "
                   f"upscaled more than 2x to data.img_size={img_size}")
    median_side = min(stats["width"].get("median", PHASH_SIDE), stats["height"].get("median", PHASH_SIDE))
    if median_side < PHASH_SIDE:
        out.append(f"the median image is {median_side:g} px on its shorter side, below the {PHASH_SIDE} px a "
                   f"perceptual hash reads: near-duplicate and near-leak findings are less reliable here (images "
                   f"under 16 px are matched by content only); trust the exact ones first")
    extreme = stats["outliers"]["extreme_aspect"]
    if extreme:
        out.append(f"{len(extreme)} image(s) are wider or taller than {EXTREME_ASPECT:g}:1; a random crop sees "
                   f"only part of them")
    return out

THUMB = 128          # thumbnail bounding box, pixels


MAX_SHOWN = 200      # entries per section shown as thumbnails (the JSON has them all)


STYLE = """
body{font-family:sans-serif;margin:16px;background:#fff;color:#222}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ccc}
.row{display:flex;flex-wrap:wrap;gap:8px;align-items:flex-start;margin:8px 0;padding:6px;border:1px solid #ddd}
figure{margin:0;width:%dpx;font-size:11px;word-break:break-all}
figure img{width:%dpx;height:%dpx;object-fit:contain;background:#eee;display:block}
.note{color:#555;font-size:13px}.bad{color:#b00}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}
""" % (THUMB, THUMB, THUMB)


def thumbnail_uri(path: str) -> str:
    """A JPEG data URI of the image shrunk into THUMB x THUMB; '' when it cannot be read."""
    try:
        img = load_rgb(path, min_size=(THUMB, THUMB))
    except (ImageDecodeError, OSError):
        return ""
    img.thumbnail((THUMB, THUMB))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(name: str, file: str, caption: str = "") -> str:
    uri = thumbnail_uri(file)
    image = f'<img src="{uri}" alt="{html.escape(name)}">' if uri else '<div class="bad">unreadable</div>'
    extra = f"<b>{html.escape(caption)}</b><br>" if caption else ""
    return f"<figure>{image}<figcaption>{extra}{html.escape(name)}</figcaption></figure>"


def _section(title: str, rows: list[str], total: int, empty: str, note: str = "") -> str:
    head = f"<h2>{html.escape(title)} ({total})</h2>"
    if note:
        head += f'<p class="note">{html.escape(note)}</p>'
    if not total:
        return head + f'<p class="note">{html.escape(empty)}</p>'
    more = (f'<p class="note">the first {MAX_SHOWN} of {total} shown; the JSON lists all</p>'
            if total > MAX_SHOWN else "")
    return head + more + "".join(rows[:MAX_SHOWN])


def _leak_rows(leaks: list[dict], fig) -> list[str]:
    rows = []
    for leak in leaks[:MAX_SHOWN]:  # one group: up to 4 members of each split it spans
        identical = " (identical bytes)" if leak["exact"] else ""
        shown = "".join(fig(p, s) for s in leak["splits"] for p in leak[s][:4])
        rows.append(f'<div class="row leak">{shown}<span class="note">{leak["count"]} images, distance '
                    f'{leak["distance"]}{identical}</span></div>')
    return rows


def render(report: dict, files: dict[str, str], title: str) -> str:
    """The page of an audit `report` (the JSON document); `files` maps each reported name to its file."""
    def fig(name, caption=""):
        return _figure(name, files.get(name, ""), caption)

    leak_rows = _leak_rows(report["leaks"], fig)
    unlabeled = report.get("unlabeled")
    dup_rows = [f'<div class="row dup"><span class="note">{html.escape(g["split"])}, {g["kind"]}, '
                f'distance up to {g["distance"]}</span>{"".join(fig(p) for p in g["paths"][:12])}</div>'
                for g in report["duplicates"][:MAX_SHOWN]]
    conflict_rows = []
    for conflict in report.get("label_conflicts", [])[:MAX_SHOWN]:
        shown = list(zip(conflict["paths"], conflict["labels"]))[:12]
        conflict_rows.append('<div class="row conflict">' + "".join(fig(p, "label: " + label) for p, label in shown)
                             + "</div>")
    issue_rows = [f'<div class="row issue">{fig(i["path"], "given: " + i["given"])}<span class="note">suggested: '
                  f'<b>{html.escape(i["suggested"])}</b>, p(given) = {i["score"]:.3f}</span></div>'
                  for i in report["label_issues"][:MAX_SHOWN]]
    counts = report["class_counts"]
    splits = list(counts)
    table = "<table><tr><th>class</th>" + "".join(f"<th>{html.escape(s)}</th>" for s in splits) + "</tr>"
    for name in next(iter(counts.values()), {}):
        table += f"<tr><td>{html.escape(name)}</td>" + "".join(f"<td>{counts[s][name]}</td>" for s in splits) + "</tr>"
    table += "</table>"
    unreadable = "".join(f"<li>{html.escape(u['path'])}: {html.escape(u['reason'])}</li>"
                         for u in report["unreadable_details"])
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
        "".join(f'<p class="note">{html.escape(line)}</p>' for line in report["summary"]),
        _section("Leaks: the same image in two splits", leak_rows, len(report["leaks"]), "no leaks found",
                 "the most serious finding: a validation image that training also sees inflates the accuracy"),
        "" if unlabeled is None else _section(
            "Unlabelled copies of held-out images (data.unlabeled)", _leak_rows(unlabeled["leaks"], fig),
            len(unlabeled["leaks"]), "no unlabelled image is a copy of a validation or test image",
            "semi-supervised training would learn these images' pseudo-labels: remove them from data.unlabeled"),
        _section("Duplicates inside a split", dup_rows, len(report["duplicates"]), "no duplicates found"),
        _section("Label conflicts: one image, different labels", conflict_rows,
                 len(report.get("label_conflicts", [])), "no label conflicts found"),
        _section("Likely label errors", issue_rows, len(report["label_issues"]),
                 "no likely label errors found" if report["label_issues_source"] else "label issues not searched",
                 report.get("label_issues_note", "")),
        outliers_section(report, fig),
        f"<h2>Unreadable files ({len(report['unreadable'])})</h2><ul>{unreadable}</ul>",
        f"<h2>Images per class</h2>{table}",
        "".join(f'<p class="note">{html.escape(line)}</p>' for line in report["advice"]),
        "</body></html>"]
    return "\n".join(parts)
