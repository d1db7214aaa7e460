"""Photo-like JPEG trees to benchmark the loader on: generated noisy photos, or crops of scikit-learn's
two real sample photos at ImageNet sizes (`benchmark.py --make-photos`)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def photo(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A photo-like RGB array: smooth colour gradients and soft blobs (low frequencies) plus sensor-like
    noise, which JPEG-compresses to a realistic few hundred KB per megapixel."""
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]
    out = np.empty((height, width, 3), dtype=np.float32)
    for c in range(3):
        a, b, d = rng.uniform(-120, 120, size=3)
        out[..., c] = 128 + a * x + b * y + d * x * y
    for _ in range(4):
        cx, cy = rng.uniform(0, 1, size=2)
        radius = rng.uniform(0.05, 0.3)
        colour = rng.uniform(-90, 90, size=3).astype(np.float32)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * radius ** 2))
        out += blob[..., None] * colour
    out += rng.normal(0, 10, size=out.shape).astype(np.float32)
    return np.clip(out, 0, 255).astype(np.uint8)


def sample_photo_crop(rng: np.random.Generator, sources: list) -> Image.Image:
    """A real photo at an ImageNet-like size: a random crop (60-100% of each side) of one of `sources` (PIL
    images), maybe mirrored or turned, resized so its long side is 400-640 px."""
    src = sources[int(rng.integers(len(sources)))]
    fraction = rng.uniform(0.6, 1.0)
    w, h = int(src.width * fraction), int(src.height * fraction)
    left, top = int(rng.integers(0, src.width - w + 1)), int(rng.integers(0, src.height - h + 1))
    img = src.crop((left, top, left + w, top + h))
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if rng.random() < 0.3:
        img = img.transpose(Image.Transpose.ROTATE_90)
    scale = rng.uniform(400, 640) / max(img.size)
    return img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.Resampling.LANCZOS)


def write_photo_tree(root: Path, train_images: int = 200, val_images: int = 40, classes: int = 4, seed: int = 0,
                     quality: int = 90, source: str = "generated") -> Path:
    """root/{train,val}/class_k/*.jpg.

    source `generated`: photo-like JPEGs of 500x375 up to 1024x768 (landscape and portrait) with sensor-like
    noise, at `quality` (decode-heavy). `samples`: crops of scikit-learn's two real sample photos
    (china.jpg, flower.jpg, 640x427) at 400-640 px, quality 85-95, the sizes of ImageNet's photos."""
    rng = np.random.default_rng(seed)
    sources = []
    if source == "samples":
        from sklearn.datasets import load_sample_images

        sources = [Image.fromarray(array) for array in load_sample_images().images]
    for split, count in (("train", train_images), ("val", val_images)):
        for i in range(count):
            folder = Path(root) / split / f"class_{i % classes}"
            folder.mkdir(parents=True, exist_ok=True)
            if sources:
                img = sample_photo_crop(rng, sources)
                img.save(folder / f"{i:05d}.jpg", quality=int(rng.integers(85, 96)))
                continue
            width = int(rng.integers(500, 1025))
            height = int(round(width * 0.75))
            if rng.random() < 0.25:
                width, height = height, width
            Image.fromarray(photo(rng, width, height)).save(folder / f"{i:05d}.jpg", quality=quality)
    return Path(root)
