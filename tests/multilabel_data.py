"""Generated multi-label data for the tests: each of four tags paints its own quadrant, so the tags are
learnable in a few steps and independent of each other."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from PIL import Image

TAGS = ["cloud", "road", "tree", "water"]


def tag_image(tags: list[int], rng, size: int = 24) -> Image.Image:
    pixels = rng.normal(90, 25, size=(size, size, 3))
    half = size // 2
    for t in tags:
        top, left = (t // 2) * half, (t % 2) * half
        pixels[top:top + half, left:left + half, t % 3] += 120
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def make_tag_list(root: Path, n: int, name: str = "list.csv", seed: int = 0, delimiter: str = " ") -> Path:
    """`n` images under root/images/ and root/<name> (columns path,label; tags joined by `delimiter`); about
    one image in eight has no tag."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    path = root / name
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "label"])
        for i in range(n):
            tags = [t for t in range(len(TAGS)) if rng.random() < 0.4]
            file = f"images/{Path(name).stem}_{i:04d}.png"
            tag_image(tags, rng).save(root / file)
            writer.writerow([file, delimiter.join(TAGS[t] for t in tags)])
    return path
