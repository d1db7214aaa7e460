"""The measurement behind audit.near_threshold: perceptual-hash (pHash) Hamming distances between an image
and its near copies (re-encoded, resized, brightened, trimmed) against those between distinct images, on
three kinds of images: crops of scikit-learn's two sample photos, generated photo-like images, and
scikit-learn's handwritten digits (8x8, so distinct digits of one class look alike).

python -m imgcls.benchmarking.near_threshold [--per-source N]   prints one JSON object
python -m imgcls.benchmarking.near_threshold --pixels [--per-source N]   the pixel-level confirmation instead: per kind of
    copy, its lowest thumbnail score and the share the audit reports (pHash within 6 bits and the score
    confirmed); per source, the distinct pairs pHash proposes and how many the confirmation lets through
"""
from __future__ import annotations

import argparse
import io
import json
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance

from imgcls.auditing.duplicates import hash_array, image_facts, near_pairs
from imgcls.benchmarking.modes import photo

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


def photo_crops(n: int, rng: np.random.Generator) -> list[Image.Image]:
    """`n` random square crops (30-60% of the shorter side) of scikit-learn's bundled sample photos."""
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(a) for a in load_sample_images().images]
    crops = []
    for _ in range(n):
        src = photos[int(rng.integers(len(photos)))]
        side = int(rng.uniform(0.3, 0.6) * min(src.size))
        left, top = int(rng.integers(0, src.width - side)), int(rng.integers(0, src.height - side))
        crops.append(src.crop((left, top, left + side, top + side)))
    return crops


def sources(n: int, rng: np.random.Generator) -> dict[str, list[Image.Image]]:
    from sklearn.datasets import load_digits

    crops = photo_crops(n, rng)
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


def small_sources(n: int, rng: np.random.Generator) -> dict[str, list[Image.Image]]:
    """Images of 24-32 px, where pHash alone proposes distinct images: digits scaled up to 32 px (all 1797,
    the case that needed the confirmation), generated photos, crops of the sample photos, noise patterns."""
    from sklearn.datasets import load_digits

    digits = [Image.fromarray(np.clip(d * 255 / 16, 0, 255).round().astype(np.uint8)).convert("RGB")
              .resize((32, 32), Image.Resampling.BILINEAR) for d in load_digits().images]
    crops = [crop.resize((32, 32), Image.Resampling.BOX) for crop in photo_crops(n, rng)]
    noise = [Image.fromarray(np.clip(np.full((24, 24, 3), 100.0) + rng.normal(0, 20, (24, 24, 3)), 0, 255)
                             .astype(np.uint8)) for _ in range(n)]
    return {"digits_32px": digits, "generated_photos_32px": [Image.fromarray(photo(rng, 32, 32)) for _ in range(n)],
            "photo_crops_32px": crops, "noise_24px": noise,
            "generated_photos_256px": [Image.fromarray(photo(rng, 256, 192)) for _ in range(n // 3)]}


def pixel_copies(img: Image.Image) -> dict[str, Image.Image]:
    """near_copies plus shifts by 1 and 2 px (the edge repeated) and a darker copy."""
    out = near_copies(img)
    a = np.asarray(img)
    h, w = a.shape[:2]
    for dx, dy in ((1, 0), (2, 1)):
        out[f"shift_{dx}_{dy}px"] = Image.fromarray(np.pad(a, ((dy, 0), (dx, 0), (0, 0)), mode="edge")[:h, :w])
    out["darker_20pc"] = ImageEnhance.Brightness(img).enhance(0.8)
    return out


def measure_pixels(images: list[Image.Image], folder: Path, tag: str, copies_of: int) -> dict:
    from imgcls.auditing.duplicates import copy_groups, near_matchable, required_scores, similarity, thumbnails

    def facts_of(imgs, name):
        out = []
        for i, im in enumerate(imgs):
            path = folder / f"{name}_{i}.png"
            im.save(path)
            out.append(image_facts(str(path)))
        return out

    originals = facts_of(images, tag)
    scores: dict[str, list[float]] = {}
    found: dict[str, list[bool]] = {}
    for i, img in enumerate(images[:copies_of]):
        for kind, copy in pixel_copies(img).items():
            a, c = originals[i], facts_of([copy], f"{tag}_{kind}_{i}")[0]
            t, m = thumbnails([a.thumb, c.thumb])
            score = float(similarity(t[0], m[0], t[1:], m[1:])[0])
            need = float(required_scores(0.99, a.reencode, np.array([c.reencode]), min(a.width, a.height),
                                         np.array([min(c.width, c.height)]))[0])
            scores.setdefault(kind, []).append(score)
            found.setdefault(kind, []).append(score >= need and bin(a.phash ^ c.phash).count("1") <= 6
                                              and near_matchable(c))
    hashes = hash_array([f.phash for f in originals])
    ok = [near_matchable(f) for f in originals]
    proposed = len([1 for i, j, _ in near_pairs(hashes, hashes, 6, same=True, ok_a=ok, ok_b=ok)])
    t, m = thumbnails([f.thumb for f in originals])
    reencode = np.array([f.reencode for f in originals])
    sides = np.array([min(f.width, f.height) for f in originals])

    def confirm(i, cols):
        return similarity(t[i], m[i], t[cols], m[cols]) >= required_scores(0.99, reencode[i], reencode[cols],
                                                                            sides[i], sides[cols])
    groups = copy_groups([f.sha256 for f in originals], hashes, 6, ok, confirm)
    return {"images": len(images), "reencode_score_median": round(float(np.median(reencode)), 4),
            "copies": {k: {"min_score": round(min(v), 4), "reported": round(float(np.mean(found[k])), 3)}
                       for k, v in scores.items()},
            "distinct_pairs_proposed_by_phash": proposed,
            "distinct_images_reported_as_copies": sum(len(g["members"]) for g in groups)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-source", type=int, default=150, help="distinct images per kind")
    parser.add_argument("--pixels", action="store_true", help="measure the pixel-level confirmation")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        if args.pixels:
            result = {name: measure_pixels(images, Path(tmp), name, min(60, args.per_source))
                      for name, images in small_sources(args.per_source, rng).items()}
        else:
            result = {name: measure(images, Path(tmp), name) for name, images in sources(args.per_source, rng).items()}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
