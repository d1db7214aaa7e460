"""From the listed images and their hashes to the audit's findings, named as training names the files:
duplicate groups inside each split, leak groups across splits, copies filed under different labels, and the
training split without the copies."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from imgcls.auditing.duplicates import copy_groups, hash_array
from imgcls.auditing.hashing import ImageFacts
from imgcls.auditing.audit_data import AuditItem
from imgcls.auditing.pixel_match import required_scores, similarity, thumbnails

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
    what auditing.pixel_match requires of the pair at `pixel_threshold` (None: pHash alone)."""
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
