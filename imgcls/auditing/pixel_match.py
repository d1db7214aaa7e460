"""The pixel-level check that confirms a perceptual-hash candidate before the audit reports it as a copy:
both images as 32x32 grayscale thumbnails (box-filtered from the decoded image), compared by their
normalised cross-correlation (NCC: brightness and contrast changes cancel), the best over shifts of up to
2 thumbnail pixels each way (a copy cropped or padded by a few pixels lines up again).

How high a copy scores depends on the image: a JPEG re-encode of a smooth 32 px digit keeps 0.998, of a
noisy 32 px texture 0.77, while two distinct digits reach 0.989. So each image also carries its own score
against its JPEG (q75) re-encode, its `reencode_score`, and a candidate pair is a copy when

    score >= max(FLOOR, 1 - max(allowance, SLACK x (1 - the pair's lower reencode_score)))

with allowance = 1 - audit.pixel_threshold (0.01) when the smaller image's shorter side is under
SMALL_SIDE (where pHash proposes distinct images: 8x8 glyphs scaled up), else LARGE_ALLOWANCE (0.1: pHash
alone is reliable there, and a 10 % brighter photo, clipped, scores 0.97). That is: at least 0.99 for clean
small images, within SLACK times the loss a re-encode alone causes for noisy ones, never below FLOOR. Why
NCC and not SSIM: SSIM put JPEG q40 copies of digits (0.936) below distinct digits (0.944). The figures per
kind of copy are in docs/hardening.md (`python -m imgcls.benchmarking.near_threshold --pixels`).

A flat thumbnail (no contrast: NCC undefined) matches another flat one of nearly the same colour only.
"""
from __future__ import annotations

import numpy as np
from PIL import Image

THUMB_SIDE = 32
MAX_SHIFT = 2          # thumbnail pixels each way
FLAT_STD = 1.0         # a thumbnail with less contrast than this (grey levels) is flat
FLAT_COLOUR_TOLERANCE = 12.0  # flat images match when every channel mean is this close (of 255)
SLACK = 3.0            # a copy may lose this many times what a JPEG re-encode of the image loses
SMALL_SIDE = 64        # below this shorter side pHash proposes distinct images: the strict allowance applies
LARGE_ALLOWANCE = 0.1  # the allowance for larger images
FLOOR = 0.5            # ... but never score below this
REENCODE_QUALITY = 75
REENCODE_MAX_SIDE = 128  # the re-encode is made of the image reduced to this (it is seen as a thumbnail)


def thumbnail(rgb: Image.Image) -> bytes:
    """The 32x32 grayscale thumbnail (1 KB) and the three channel means (3 bytes) of a decoded RGB image."""
    small = rgb.resize((THUMB_SIDE, THUMB_SIDE), Image.Resampling.BOX)
    means = np.asarray(small, dtype=np.float32).reshape(-1, 3).mean(axis=0)
    return np.asarray(small.convert("L"), dtype=np.uint8).tobytes() + bytes(np.clip(means.round(), 0, 255)
                                                                          .astype(np.uint8))


def reencode_score(rgb: Image.Image) -> float:
    """The aligned NCC of an image's thumbnail with that of its JPEG (q75) re-encode: how much of the
    thumbnail a harmless copy keeps, for this image."""
    import io

    small = rgb.copy()
    small.thumbnail((REENCODE_MAX_SIDE, REENCODE_MAX_SIDE), Image.Resampling.BOX)
    buf = io.BytesIO()
    small.save(buf, format="JPEG", quality=REENCODE_QUALITY)
    buf.seek(0)
    with Image.open(buf) as copy:
        copy = copy.convert("RGB")
    a, a_mean = thumbnails([thumbnail(small)])
    b, b_means = thumbnails([thumbnail(copy)])
    return float(similarity(a[0], a_mean[0], b, b_means)[0])


def required_scores(strict: float, reencode_a: float, reencode_b: np.ndarray, side_a: int = 0,
                    sides_b: np.ndarray = None) -> np.ndarray:
    """The score each candidate pair needs (see the module's doc); `side_*`: the images' shorter sides."""
    loss = 1.0 - np.minimum(reencode_a, reencode_b)
    sides = np.minimum(side_a, sides_b if sides_b is not None else np.zeros_like(reencode_b))
    allowance = np.where(sides < SMALL_SIDE, 1.0 - strict, max(1.0 - strict, LARGE_ALLOWANCE))
    return np.maximum(FLOOR, 1.0 - np.maximum(allowance, SLACK * loss))


def thumbnails(blobs: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(n, 32, 32) float32 thumbnails and (n, 3) channel means from `thumbnail`'s bytes."""
    n, side = len(blobs), THUMB_SIDE * THUMB_SIDE
    raw = np.frombuffer(b"".join(blobs), dtype=np.uint8).reshape(n, side + 3) if n else np.zeros((0, side + 3),
                                                                                                 np.uint8)
    return raw[:, :side].reshape(n, THUMB_SIDE, THUMB_SIDE).astype(np.float32), raw[:, side:].astype(np.float32)


def similarity(a: np.ndarray, a_mean: np.ndarray, b: np.ndarray, b_means: np.ndarray) -> np.ndarray:
    """The aligned NCC of thumbnail `a` (32, 32) with each of `b` (k, 32, 32): the best over shifts of up to
    MAX_SHIFT pixels, on the overlapping part. Flat pairs score 1.0 when their colours agree, else 0."""
    s, best = THUMB_SIDE, np.full(len(b), -1.0, dtype=np.float64)
    for dy in range(-MAX_SHIFT, MAX_SHIFT + 1):
        for dx in range(-MAX_SHIFT, MAX_SHIFT + 1):
            pa = a[max(dy, 0):s + min(dy, 0), max(dx, 0):s + min(dx, 0)].astype(np.float64)
            pb = b[:, max(-dy, 0):s + min(-dy, 0), max(-dx, 0):s + min(-dx, 0)].astype(np.float64)
            pa = pa - pa.mean()
            pb = pb - pb.mean(axis=(1, 2), keepdims=True)
            num = (pa[None] * pb).sum(axis=(1, 2))
            den = np.sqrt((pa * pa).sum() * (pb * pb).sum(axis=(1, 2)))
            with np.errstate(invalid="ignore", divide="ignore"):
                score = np.where(den > 0, num / np.where(den > 0, den, 1.0), -1.0)
            best = np.maximum(best, score)
    flat_a = a.std() < FLAT_STD
    flat_b = b.reshape(len(b), -1).std(axis=1) < FLAT_STD
    same_colour = np.abs(b_means - a_mean[None]).max(axis=1) <= FLAT_COLOUR_TOLERANCE
    best = np.where(flat_a | flat_b, np.where(flat_a & flat_b & same_colour, 1.0, 0.0), best)
    return best
