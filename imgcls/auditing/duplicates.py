"""Grayscale images filed among colour ones (audit.py's `outliers`, beside the fold models' feature score):
a scan, an X-ray or a black-and-white photo in a class of colour photos is another kind of image, whatever its
file stores (an RGB JPEG of a gray picture has three equal channels). Measured on the decoded image alone, so
it needs no model and runs in every audit.

The pixel-level check that confirms a perceptual-hash candidate before the audit reports it as a copy:
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

Per-image facts for the audit, computed in DataLoader workers: the SHA-256 of the file's bytes (exact
copies), a 64-bit perceptual hash (imagehash's pHash of the image decoded exactly as training decodes it:
EXIF orientation, 16-bit and alpha handling, by `data.images`), a 32x32 grayscale thumbnail that confirms
near matches pixel by pixel (auditing.duplicates), and the stored size, mode and format.

A file that cannot be opened or decoded gets its reason instead (the message training would log).

Groups of copies among the images: pure functions of the hashes (and a confirmation callback).

Near means a perceptual-hash Hamming distance up to a threshold, confirmed pixel by pixel
(auditing.duplicates); exact means the same SHA-256 of the file's bytes. Candidates are found by
comparing every hash with every other in blocks (XOR and a bit count over uint64 arrays): exact and fast up
to some 10^5 images.

From the listed images and their hashes to the audit's findings, named as training names the files:
duplicate groups inside each split, leak groups across splits, copies filed under different labels, and the
training split without the copies."""
from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional

import imagehash
import numpy as np
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from imgcls.auditing.audit_data import AuditItem
from imgcls.data.datasets import describe_failure
from imgcls.data.images import (ImageDecodeError, decode_rgb, first_band_view, is_npy, is_tiff, open_image,
                                oriented_size, read_bands)
from imgcls.data.transforms import read_file_bytes, reads_bands

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

@dataclass
class ImageFacts:
    sha256: str = ""
    phash: int = 0          # 64 bits, imagehash.phash (8x8 DCT signs of a 32x32 grayscale)
    width: int = 0          # displayed (EXIF orientation applied)
    height: int = 0
    mode: str = ""          # as stored ('RGB', 'L', 'RGBA', 'I;16', ...)
    format: str = ""
    error: Optional[str] = None
    thumb: bytes = b""      # auditing.duplicates.thumbnail: confirms a pHash candidate pixel by pixel
    reencode: float = 1.0   # auditing.duplicates.reencode_score: what a harmless copy of it scores
    chroma: float = 0.0     # auditing.duplicates.chroma: 0 for a grayscale image, however stored


def image_facts(path: str, channels: int = 3, value_range=None) -> ImageFacts:
    if reads_bands(channels, value_range):
        return band_facts(path, channels, value_range)
    try:
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        img = open_image(path)
        mode, fmt, (width, height) = img.mode, img.format or "", oriented_size(img)
        rgb = decode_rgb(img, path)
    except (ImageDecodeError, OSError) as err:
        return ImageFacts(error=describe_failure(path, err))
    return ImageFacts(digest, int(str(imagehash.phash(rgb)), 16), width, height, mode, fmt, thumb=thumbnail(rgb),
                      reencode=reencode_score(rgb), chroma=chroma(rgb))


def hash_view_words(channels: int, value_range) -> str:
    """What the perceptual hashes and thumbnails are computed on, for the report."""
    if not reads_bands(channels, value_range):
        return "the image as training decodes it (8-bit RGB)"
    return (f"the first of {channels} band(s), stretched from its own minimum to its maximum (data.channels="
            f"{channels}): near copies are judged on that band alone")


def band_facts(path: str, channels: int, value_range) -> ImageFacts:
    """`image_facts` of a file read as N bands: its first band, stretched to 8 bits between its own extremes
    (so a 16-bit band whose values span a few 8-bit steps still has structure to hash), as a grayscale image."""
    try:
        name, buf = read_file_bytes(path)
        digest = hashlib.sha256(buf).hexdigest()
        array = read_bands(buf, name, channels, value_range)
    except (ImageDecodeError, OSError) as err:
        return ImageFacts(error=describe_failure(path, err))
    view = first_band_view(array)
    fmt = "NPY" if is_npy(buf) else "TIFF" if is_tiff(buf) else ""
    return ImageFacts(digest, int(str(imagehash.phash(view)), 16), array.shape[1], array.shape[0],
                      f"{channels} band(s)", fmt, thumb=thumbnail(view), reencode=reencode_score(view))


class FactsDataset(Dataset):
    def __init__(self, files: list[str], channels: int = 3, value_range=None):
        self.files = files
        self.channels, self.value_range = channels, value_range

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> ImageFacts:
        return image_facts(self.files[i], self.channels, self.value_range)


def _as_list(batch):
    return batch


def compute_facts(files: list[str], num_workers: int, progress=None, channels: int = 3,
                  value_range=None) -> list[ImageFacts]:
    """`image_facts` of every file, in order, `num_workers` loader processes decoding in parallel;
    `progress(n)` is called with the number of files done in each batch."""
    batch = 32
    loader = DataLoader(FactsDataset(files, channels, value_range), batch_size=batch, shuffle=False,
                        collate_fn=_as_list,
                        num_workers=num_workers if len(files) > batch else 0,
                        prefetch_factor=4 if num_workers and len(files) > batch else None)
    out: list[ImageFacts] = []
    for facts in loader:
        out.extend(facts)
        if progress is not None:
            progress(len(facts))
    return out

BLOCK = 512  # rows compared at once: BLOCK x n distances in memory (uint8)


def hash_array(hashes: list[int]) -> np.ndarray:
    return np.array(hashes, dtype=np.uint64)


def near_pairs(a: np.ndarray, b: np.ndarray, threshold: int, same: bool, ok_a: Optional[list[bool]] = None,
               ok_b: Optional[list[bool]] = None) -> list[tuple[int, int, int]]:
    """(i, j, distance) for every a[i], b[j] within `threshold` bits; with `same` (a is b), only i < j. `ok_a`,
    `ok_b`: which hashes may near-match at all (an image too small for pHash matches by content only)."""
    pairs = []
    for start in range(0, len(a), BLOCK):
        block = a[start:start + BLOCK]
        dist = np.bitwise_count(block[:, None] ^ b[None, :])
        rows, cols = np.nonzero(dist <= threshold)
        for r, c in zip(rows.tolist(), cols.tolist()):
            i = start + r
            if (not same or i < c) and (ok_a is None or ok_a[i]) and (ok_b is None or ok_b[c]):
                pairs.append((i, c, int(dist[r, c])))
    return pairs


def exact_groups(digests: list[str]) -> list[list[int]]:
    """Positions sharing a content hash, groups of two or more, in first-seen order."""
    by_digest: dict[str, list[int]] = defaultdict(list)
    for i, digest in enumerate(digests):
        by_digest[digest].append(i)
    return [members for members in by_digest.values() if len(members) > 1]


def copy_groups(digests: list[str], hashes: np.ndarray, threshold: int, near_ok: list[bool],
                confirm: Optional[Callable[[int, np.ndarray], np.ndarray]] = None) -> list[dict]:
    """Groups of copies among all the images, whatever their split: {"members": sorted positions, "exact":
    all members share one SHA-256, "distance": the largest pHash distance of an edge that joined them}.
    Byte-identical files always join; a pHash candidate (within `threshold` bits, both `near_ok`) joins only
    when `confirm(i, candidates)` (a bool per candidate j) says it is a copy. Nothing grows with the square of
    the copies: the candidates are found block by block, and a candidate already in i's group is skipped
    before any confirmation, so a cluster of k near-identical images costs about k confirmations per row,
    and the groups are held as one label per image."""
    n = len(digests)
    group = np.arange(n)
    largest: dict[int, int] = {}

    def join(i: int, others: np.ndarray, distances: np.ndarray) -> None:
        labels = np.unique(np.concatenate(([group[i]], group[others])))
        target = int(labels.min())
        far = max([largest.pop(int(g), 0) for g in labels] + [int(distances.max()) if len(distances) else 0])
        if len(labels) > 1:
            group[np.isin(group, labels)] = target
        largest[target] = far

    for members in exact_groups(digests):
        join(members[0], np.array(members[1:]), np.zeros(0, dtype=np.int64))
    ok = np.asarray(near_ok, dtype=bool)
    for start in range(0, n, BLOCK):
        block = hashes[start:start + BLOCK]
        dist = np.bitwise_count(block[:, None] ^ hashes[None, :])
        for r in range(len(block)):
            i = start + r
            if not ok[i]:
                continue
            cols = np.nonzero((dist[r, i + 1:] <= threshold) & ok[i + 1:])[0] + i + 1
            cols = cols[group[cols] != group[i]]
            if not len(cols):
                continue
            if confirm is not None:
                cols = cols[confirm(i, cols)]
            if len(cols):
                join(i, cols, dist[r, cols].astype(np.int64))
    by_label: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(group.tolist()):
        by_label[g].append(i)
    return [{"members": m, "exact": len({digests[i] for i in m}) == 1, "distance": largest.get(g, 0)}
            for g, m in sorted(by_label.items()) if len(m) > 1]

SPLIT_ORDER = ("train", "val", "test")


def by_split(items: list[AuditItem], facts: list[ImageFacts]) -> dict[str, list[int]]:
    """split -> positions of its readable images, splits in training's order."""
    out: dict[str, list[int]] = {}
    for i, (item, fact) in enumerate(zip(items, facts)):
        if fact.error is None:
            out.setdefault(item.split, []).append(i)
    return {s: out[s] for s in sorted(out, key=lambda s: SPLIT_ORDER.index(s) if s in SPLIT_ORDER else 99)}


# Below this shorter side an image matches by content only: pHash upscales it to 32x32, and distinct 8x8
# digits fell within a few bits of each other (python -m imgcls.benchmarking.near_threshold); 24 px images kept their
# re-encoded copies within the threshold and distinct images apart.
NEAR_MIN_SIDE = 16


def near_matchable(fact: ImageFacts) -> bool:
    """Whether an image may take part in near matches (else exact ones only): see NEAR_MIN_SIDE."""
    return min(fact.width, fact.height) >= NEAR_MIN_SIDE


def find_copies(items, facts, splits: dict[str, list[int]], threshold: int, pixel_threshold: Optional[float],
                label_name: Callable[[AuditItem], str]) -> tuple[list[dict], list[dict], list[dict]]:
    """(duplicates, leaks, label_conflicts) from one grouping of every readable image's copies:
    duplicates [{"split", "paths", "kind", "distance"}] (a group's members inside one split, exact groups
    first); leaks [{<split>: [paths] for every split, "exact", "distance", "splits", "count"}] (one entry per
    group that spans two or more splits, exact first); label_conflicts [{"paths", "labels", "splits"}] (a
    group whose members carry different labels). A pHash candidate counts only when its thumbnails' score reaches
    what auditing.duplicates requires of the pair at `pixel_threshold` (None: pHash alone)."""
    positions = [i for members in splits.values() for i in members]
    if pixel_threshold is None:
        confirm = None
    else:
        thumbs, means = thumbnails([facts[i].thumb for i in positions])
        reencode = np.array([facts[i].reencode for i in positions], dtype=np.float64)
        sides = np.array([min(facts[i].width, facts[i].height) for i in positions])

        def confirm(i: int, cols: np.ndarray) -> np.ndarray:
            return (similarity(thumbs[i], means[i], thumbs[cols], means[cols])
                    >= required_scores(pixel_threshold, reencode[i], reencode[cols], sides[i], sides[cols]))
    groups = copy_groups([facts[i].sha256 for i in positions], hash_array([facts[i].phash for i in positions]),
                         threshold, [near_matchable(facts[i]) for i in positions], confirm)
    names = list(splits)
    duplicates, leaks, conflicts = [], [], []
    for group in groups:
        members = [positions[m] for m in group["members"]]
        per_split = {s: [i for i in members if items[i].split == s] for s in names}
        for split, inside in per_split.items():
            if len(inside) > 1:
                exact = len({facts[i].sha256 for i in inside}) == 1
                duplicates.append({"split": split, "paths": [items[i].name for i in inside],
                                   "kind": "exact" if exact else "near", "distance": group["distance"]})
        spanned = [s for s in names if per_split[s]]
        if len(spanned) > 1:
            leaks.append({**{s: [items[i].name for i in per_split[s]] for s in names}, "exact": group["exact"],
                          "distance": group["distance"], "splits": spanned, "count": len(members)})
        labels = [label_name(items[i]) for i in members]
        if len(set(labels)) > 1:
            conflicts.append({"paths": [items[i].name for i in members], "labels": labels, "splits": spanned})
    order = {s: k for k, s in enumerate(SPLIT_ORDER)}
    duplicates.sort(key=lambda g: (g["kind"] != "exact", order.get(g["split"], 99)))
    leaks.sort(key=lambda x: (not x["exact"], x["distance"]))
    return duplicates, leaks, conflicts


def clean_training_names(items, facts, duplicates: list[dict], leaks: list[dict], dropped_issues: list[str],
                         conflicts: list[dict] = ()) -> list[AuditItem]:
    """The training split without: unreadable files, the training side of every leak, all but the first
    member of each training duplicate group, every copy of a label conflict (which label is right is for a
    person to say), and the label issues named in `dropped_issues`."""
    drop = {name for leak in leaks for name in leak.get("train", ())}
    for group in duplicates:
        if group["split"] == "train":
            drop.update(group["paths"][1:])
    for conflict in conflicts:
        drop.update(conflict["paths"])
    drop.update(dropped_issues)
    return [item for item, fact in zip(items, facts)
            if item.split == "train" and fact.error is None and item.name not in drop]
