"""Groups of copies among the images: pure functions of the hashes (and a confirmation callback).

Near means a perceptual-hash Hamming distance up to a threshold, confirmed pixel by pixel
(auditing.pixel_match); exact means the same SHA-256 of the file's bytes. Candidates are found by
comparing every hash with every other in blocks (XOR and a bit count over uint64 arrays): exact and fast up
to some 10^5 images.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Optional

import numpy as np

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
