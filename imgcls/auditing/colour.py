"""Grayscale images filed among colour ones (audit.py's `outliers`, beside the fold models' feature score):
a scan, an X-ray or a black-and-white photo in a class of colour photos is another kind of image, whatever its
file stores (an RGB JPEG of a gray picture has three equal channels). Measured on the decoded image alone, so
it needs no model and runs in every audit."""
from __future__ import annotations

import numpy as np
from PIL import Image

CHROMA_SIDE = 32
GRAY_MAX = 0.02        # mean channel spread (of 255) at most this: grayscale (JPEG noise stays under 0.01)
COLOUR_MIN = 0.05      # ... at least this: a colour image
COLOUR_SHARE = 0.9     # a class whose images are at least this share colour makes its grayscale images foreign
MIN_CLASS_IMAGES = 5   # fewer readable images in a class: no rule of what the class looks like


def chroma(rgb: Image.Image) -> float:
    """The mean over a 32x32 thumbnail of max(R, G, B) - min(R, G, B), over 255: 0 for a gray picture."""
    small = np.asarray(rgb.convert("RGB").resize((CHROMA_SIDE, CHROMA_SIDE), Image.Resampling.BOX), dtype=np.float32)
    return round(float((small.max(axis=2) - small.min(axis=2)).mean() / 255.0), 4)


def grayscale_outliers(names: list[str], splits: list[str], given: list[str], chromas: list[float]) -> list[dict]:
    """[{"path", "split", "given", "score": None, "reason"}] of the grayscale images (chroma <= GRAY_MAX) in a
    class whose readable images are at least COLOUR_SHARE colour (chroma >= COLOUR_MIN); paths in input order."""
    by_class: dict[str, list[float]] = {}
    for label, value in zip(given, chromas):
        by_class.setdefault(label, []).append(value)
    colour_classes = {}
    for label, values in by_class.items():
        coloured = sum(v >= COLOUR_MIN for v in values)
        if len(values) >= MIN_CLASS_IMAGES and coloured >= COLOUR_SHARE * len(values):
            colour_classes[label] = (coloured, len(values))
    rows = []
    for name, split, label, value in zip(names, splits, given, chromas):
        if label in colour_classes and value <= GRAY_MAX:
            coloured, total = colour_classes[label]
            rows.append({"path": name, "split": split, "given": label, "score": None,
                         "reason": f"grayscale among colour images ({coloured} of the {total} images of {label} "
                                   f"are in colour)"})
    return rows
