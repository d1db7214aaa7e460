"""From the listed images and their hashes to the audit's findings, named as training names the files:
duplicate groups inside each split, leaks across splits, and the training split without the copies."""
from __future__ import annotations

from engine.audit.duplicates import duplicate_groups, hash_array, leak_pairs
from engine.audit.hashing import ImageFacts
from engine.audit.audit_data import AuditItem

SPLIT_ORDER = ("train", "val", "test")


def by_split(items: list[AuditItem], facts: list[ImageFacts]) -> dict[str, list[int]]:
    """split -> positions of its readable images, splits in training's order."""
    out: dict[str, list[int]] = {}
    for i, (item, fact) in enumerate(zip(items, facts)):
        if fact.error is None:
            out.setdefault(item.split, []).append(i)
    return {s: out[s] for s in sorted(out, key=lambda s: SPLIT_ORDER.index(s) if s in SPLIT_ORDER else 99)}


# Below this shorter side an image matches by content only: pHash upscales it to 32x32, and distinct 8x8
# digits fell within a few bits of each other (python -m benchmarking.near_threshold); 24 px images kept their
# re-encoded copies within the threshold and distinct images apart.
NEAR_MIN_SIDE = 16


def near_matchable(fact: ImageFacts) -> bool:
    """Whether an image may take part in near matches (else exact ones only): see NEAR_MIN_SIDE."""
    return min(fact.width, fact.height) >= NEAR_MIN_SIDE


def find_duplicates(items, facts, splits: dict[str, list[int]], threshold: int) -> list[dict]:
    """[{"split", "paths", "kind", "distance"}]: copies inside each split, exact groups first."""
    found = []
    for split, positions in splits.items():
        digests = [facts[i].sha256 for i in positions]
        hashes = hash_array([facts[i].phash for i in positions])
        for group in duplicate_groups(digests, hashes, threshold, [near_matchable(facts[i]) for i in positions]):
            found.append({"split": split, "paths": [items[positions[m]].name for m in group["members"]],
                          "kind": group["kind"], "distance": group["distance"]})
    return sorted(found, key=lambda g: (g["kind"] != "exact", SPLIT_ORDER.index(g["split"])
                                        if g["split"] in SPLIT_ORDER else 99))


def find_leaks(items, facts, splits: dict[str, list[int]], threshold: int) -> list[dict]:
    """[{"train", "val", "distance", "exact", "splits"}] for each copy across two splits (train against val,
    and against test where there is one; val against test), exact copies first."""
    names = list(splits)
    found = []
    for a_at, a in enumerate(names):
        for b in names[a_at + 1:]:
            pa, pb = splits[a], splits[b]
            pairs = leak_pairs([facts[i].sha256 for i in pa], hash_array([facts[i].phash for i in pa]),
                               [facts[i].sha256 for i in pb], hash_array([facts[i].phash for i in pb]), threshold,
                               [near_matchable(facts[i]) for i in pa], [near_matchable(facts[i]) for i in pb])
            found += [{a: items[pa[p["a"]]].name, b: items[pb[p["b"]]].name, "distance": p["distance"],
                       "exact": p["exact"], "splits": [a, b]} for p in pairs]
    return sorted(found, key=lambda x: (not x["exact"], x["distance"]))


def clean_training_names(items, facts, duplicates: list[dict], leaks: list[dict], dropped_issues: list[str]
                         ) -> list[AuditItem]:
    """The training split without: unreadable files, the training side of every leak, all but the first
    member of each training duplicate group, and the label issues named in `dropped_issues`."""
    drop = {leak["train"] for leak in leaks if "train" in leak}
    for group in duplicates:
        if group["split"] == "train":
            drop.update(group["paths"][1:])
    drop.update(dropped_issues)
    return [item for item, fact in zip(items, facts)
            if item.split == "train" and fact.error is None and item.name not in drop]
