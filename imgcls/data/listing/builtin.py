"""Small real data sets that ship inside a registry package, written out as class-folder trees.

`digits`: scikit-learn's 1,797 handwritten digits (8x8 grayscale, 10 classes), every fifth image of
each class held out for validation. Nothing is downloaded.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from imgcls.data.listing.folder import DataTreeError

BUILTIN = ("digits",)


def ensure_builtin(name: str, root: str | Path) -> Path:
    """Write the data set under `root` unless it is already there; returns `root`."""
    root = Path(root)
    if (root / ".complete").exists():
        return root
    if name != "digits":
        raise ValueError(f"unknown built-in data set {name!r}; known: {', '.join(BUILTIN)}")
    if root.exists() and any(root.iterdir()):
        # Never overwrite a folder that is not ours: it may be the user's own data.
        raise DataTreeError(f"'data.root' = {root} already holds files that are not the built-in '{name}' data set; "
                            f"to train on that folder set data.builtin=null, or point data.root at an empty or "
                            f"new folder for '{name}'")
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        _write_digits(staging)
        (staging / ".complete").touch()
        if root.exists():
            root.rmdir()  # empty (checked above)
        os.replace(staging, root)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return root


def _write_digits(out: Path) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    seen = {}
    for i, (image, label) in enumerate(zip(digits.images, digits.target)):
        k = seen.get(int(label), 0)
        seen[int(label)] = k + 1
        split = "val" if k % 5 == 4 else "train"
        folder = out / split / str(int(label))
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.clip(image * (255.0 / 16.0), 0, 255).round().astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:04d}.png")
