"""The measurement behind audit.near_threshold: perceptual-hash (pHash) Hamming distances between an image
and its near copies (re-encoded, resized, brightened, trimmed) against those between distinct images, on
three kinds of images: crops of scikit-learn's two sample photos, generated photo-like images, and
scikit-learn's handwritten digits (8x8, so distinct digits of one class look alike).

python -m benchmarking.near_threshold [--per-source N]   prints one JSON object
"""
from __future__ import annotations

import argparse
import io
import json
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance

from benchmarking.photos import photo
from engine.audit.duplicates import hash_array, near_pairs
from engine.audit.hashing import image_facts

THRESHOLDS = (2, 4, 6, 8, 10, 12, 14)


def near_copies(img: Image.Image) -> dict[str, Image.Image]:
    """What happens to a file on its way into a data set twice."""
    def jpeg(im, q):
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=q)
        return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")

    w, h = img.size
    half = img.resize((max(1, w // 2), max(1, h // 2)), Image.Resampling.BILINEAR)
    trim = max(1, round(0.02 * min(w, h)))
    return {"jpeg_q75": jpeg(img, 75), "jpeg_q40": jpeg(img, 40), "half_size": half, "half_size_jpeg": jpeg(half, 75),
            "brighter_10pc": ImageEnhance.Brightness(img).enhance(1.1),
            "trim_2pc": img.crop((trim, trim, w - trim, h - trim))}


def sources(n: int, rng: np.random.Generator) -> dict[str, list[Image.Image]]:
    from sklearn.datasets import load_digits, load_sample_images

    photos = [Image.fromarray(a) for a in load_sample_images().images]
    crops = []
    for _ in range(n):
        src = photos[int(rng.integers(len(photos)))]
        side = int(rng.uniform(0.3, 0.6) * min(src.size))
        left, top = int(rng.integers(0, src.width - side)), int(rng.integers(0, src.height - side))
        crops.append(src.crop((left, top, left + side, top + side)))
    generated = [Image.fromarray(photo(rng, 256, 192)) for _ in range(n)]
    digits = load_digits().images[:n]
    digit_images = [Image.fromarray(np.clip(d * 255 / 16, 0, 255).round().astype(np.uint8)).convert("RGB")
                    for d in digits]
    return {"sample_photo_crops": crops, "generated_photos": generated, "digits_8x8": digit_images}


def hashes_of(images: list[Image.Image], folder: Path, tag: str) -> list[int]:
    """pHash through the audit's own path: saved as PNG, read and decoded as training reads it."""
    out = []
    for i, img in enumerate(images):
        path = folder / f"{tag}_{i}.png"
        img.save(path)
        out.append(image_facts(str(path)).phash)
    return out


def measure(images: list[Image.Image], folder: Path, tag: str) -> dict:
    originals = hashes_of(images, folder, tag)
    near: dict[str, list[int]] = {}
    for i, img in enumerate(images):
        for kind, copy in near_copies(img).items():
            h = hashes_of([copy], folder, f"{tag}_{kind}_{i}")[0]
            near.setdefault(kind, []).append(bin(originals[i] ^ h).count("1"))
    all_near = [d for ds in near.values() for d in ds]
    distinct = [d for _, _, d in near_pairs(hash_array(originals), hash_array(originals), 64, same=True)]
    return {"images": len(images), "distinct_pairs": len(distinct),
            "near_copy_distance": {k: {"median": float(np.median(v)), "max": int(max(v))} for k, v in near.items()},
            "near_copies_found_at": {str(t): round(float(np.mean([d <= t for d in all_near])), 4) for t in THRESHOLDS},
            "distinct_min_distance": int(min(distinct)),
            "distinct_pairs_flagged_at": {str(t): int(sum(d <= t for d in distinct)) for t in THRESHOLDS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-source", type=int, default=150, help="distinct images per kind")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        result = {name: measure(images, Path(tmp), name) for name, images in sources(args.per_source, rng).items()}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
