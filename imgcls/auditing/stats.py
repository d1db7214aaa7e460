"""Balance and shape: images per class per split, the imbalance ratio, classes below a minimum, the image
sizes, aspect ratios, modes and formats, the outliers among them, and the advice that follows."""
from __future__ import annotations

from collections import Counter

import numpy as np

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
