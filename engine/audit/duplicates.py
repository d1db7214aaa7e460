"""Exact and near duplicates inside a split, and leaks across splits: pure functions of the hashes.

Near means a perceptual-hash Hamming distance up to a threshold; exact means the same SHA-256 of the file's
bytes. Pairs are found by comparing every hash with every other in blocks (XOR and a bit count over uint64
arrays): exact and fast up to some 10^5 images per split.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

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


def connected_groups(n: int, pairs: list[tuple[int, int, int]]) -> list[list[int]]:
    """The connected components (two or more members, sorted) of the graph whose edges are `pairs`."""
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i, j, _ in pairs:
        ri, rj = find(i), find(j)
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)
    groups: dict[int, list[int]] = defaultdict(list)
    for i in range(n):
        groups[find(i)].append(i)
    return sorted((g for g in groups.values() if len(g) > 1), key=lambda g: g[0])


def duplicate_groups(digests: list[str], hashes: np.ndarray, threshold: int,
                     near_ok: Optional[list[bool]] = None) -> list[dict]:
    """Groups of copies inside one split: {"members": positions, "kind": "exact" | "near", "distance": the
    largest pairwise pHash distance that joined them}. A group is exact when all its members share one SHA-256."""
    pairs = near_pairs(hashes, hashes, threshold, same=True, ok_a=near_ok, ok_b=near_ok)
    for group in exact_groups(digests):  # byte-identical files always group, whatever the threshold
        pairs += [(group[0], other, 0) for other in group[1:]]
    largest: dict[int, int] = defaultdict(int)
    groups = connected_groups(len(digests), pairs)
    root_of = {i: g[0] for g in groups for i in g}
    for i, j, d in pairs:
        largest[root_of[i]] = max(largest[root_of[i]], d)
    return [{"members": g, "kind": "exact" if len({digests[i] for i in g}) == 1 else "near",
             "distance": largest[g[0]]} for g in groups]


def leak_pairs(digests_a: list[str], hashes_a: np.ndarray, digests_b: list[str], hashes_b: np.ndarray,
               threshold: int, near_ok_a: Optional[list[bool]] = None,
               near_ok_b: Optional[list[bool]] = None) -> list[dict]:
    """Every pair (a in one split, b in another) that is a copy: {"a", "b", "distance", "exact"}, exact
    first, then by distance."""
    found = {(i, j): d for i, j, d in near_pairs(hashes_a, hashes_b, threshold, same=False, ok_a=near_ok_a,
                                                ok_b=near_ok_b)}
    by_digest: dict[str, list[int]] = defaultdict(list)
    for j, digest in enumerate(digests_b):
        by_digest[digest].append(j)
    for i, digest in enumerate(digests_a):
        for j in by_digest.get(digest, ()):
            found[(i, j)] = 0
    leaks = [{"a": i, "b": j, "distance": d, "exact": digests_a[i] == digests_b[j]} for (i, j), d in found.items()]
    return sorted(leaks, key=lambda x: (not x["exact"], x["distance"], x["a"], x["b"]))
