"""Generated multi-label data for the tests: each of four tags adds its own mark to the whole image (a red,
green or blue cast, a checkerboard texture), so the tags are independent of each other, survive crops and
flips, and are learnable in a few steps."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from PIL import Image

TAGS = ["cloud", "road", "tree", "water"]


def tag_image(tags: list[int], rng, size: int = 24, strength: float = 120) -> Image.Image:
    pixels = rng.normal(90, 25, size=(size, size, 3))
    for t in tags:
        if t < 3:
            pixels[..., t] += strength          # a colour cast
        else:
            pixels[::2, ::2] += strength        # a fine checkerboard texture
            pixels[1::2, 1::2] += strength
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def make_tag_list(root: Path, n: int, name: str = "list.csv", seed: int = 0, delimiter: str = " ",
                  strength: float = 120) -> Path:
    """`n` images under root/images/ and root/<name> (columns path,label; tags joined by `delimiter`); about
    one image in eight has no tag. `strength`: how much a tag brightens its quadrant (noise sd 25)."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    path = root / name
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "label"])
        for i in range(n):
            tags = [t for t in range(len(TAGS)) if rng.random() < 0.4]
            file = f"images/{Path(name).stem}_{i:04d}.png"
            tag_image(tags, rng, strength=strength).save(root / file)
            writer.writerow([file, delimiter.join(TAGS[t] for t in tags)])
    return path
