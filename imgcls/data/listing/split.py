"""A stratified, seeded hold-out split of one labelled index (`data.val_fraction`, `data.split_seed`).

The split is a pure function of the files' paths relative to the data root, their labels, the fraction
and the seed: each class's files are ordered by a SHA-256 of (seed, relative path) and the first
round(n x fraction) of them are held out. No Python `hash()` (salted per process) and no RNG whose
stream could change between library versions, so every machine and run gets the same split, and adding
a file to one class never moves files of another.
"""
from __future__ import annotations

import csv
import hashlib
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from imgcls.core.errors import DataTreeError

from imgcls.data.listing.folder import ImageIndex

log = logging.getLogger(__name__)


def relative_key(path: str, base: Path) -> str:
    """The machine-independent name of a file: its path under `base`, with '/' separators."""
    return Path(os.path.relpath(path, base)).as_posix()


def held_out_count(n: int, fraction: float) -> int:
    """How many of a class's `n` files go to validation: round(n x fraction) (halves up), at least one on each
    side where the class has two or more, none where it has one."""
    if n < 2:
        return 0
    return max(1, min(n - 1, math.floor(n * fraction + 0.5)))


def split_positions(keys: list[str], labels: list[int], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training positions, validation positions) into `keys`, each in the input order."""
    by_class: dict[int, list[int]] = {}
    for position, label in enumerate(labels):
        by_class.setdefault(label, []).append(position)
    held_out: set[int] = set()
    for members in by_class.values():
        ranked = sorted(members, key=lambda p: hashlib.sha256(f"{seed}\0{keys[p]}".encode()).digest())
        held_out.update(ranked[:held_out_count(len(members), fraction)])
    train = [p for p in range(len(keys)) if p not in held_out]
    return train, sorted(held_out)


@dataclass
class SplitRecord:
    """The split as it goes into the checkpoint and the run directory: relative paths and labels per side."""

    val_fraction: float
    split_seed: int
    train: list[str]
    train_labels: list[int]
    val: list[str]
    val_labels: list[int]

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def check_split_sides(train: list, val: list, fraction: float) -> None:
    """DataTreeError (exit 2, before training) when a hold-out split leaves either side empty."""
    if not train or not val:
        empty = "validation" if not val else "training"
        raise DataTreeError(f"data.val_fraction={fraction}: the split of {len(train) + len(val)} image(s) leaves "
                            f"the {empty} side empty; use more images, another data.val_fraction, or a "
                            f"validation list (data.val_csv)")


def split_index(index: ImageIndex, base: Path, fraction: float, seed: int
                ) -> tuple[ImageIndex, ImageIndex, SplitRecord]:
    """Split `index` (paths under `base`) into training and validation indexes and their record. A class with
    a single file stays in training, named in a warning; a side left empty is a DataTreeError."""
    keys = [relative_key(p, base) for p in index.paths]
    train, val = split_positions(keys, index.labels, fraction, seed)
    check_split_sides(train, val, fraction)
    singles = [name for name, n in zip(index.classes, index.class_counts()) if n == 1]
    if singles:
        log.warning("data.val_fraction: %d class(es) have a single image, kept for training and absent from "
                    "validation: %s", len(singles), ", ".join(singles))

    def side(positions):
        return ImageIndex(index.root, list(index.classes), [index.paths[p] for p in positions],
                                [index.labels[p] for p in positions])

    record = SplitRecord(fraction, seed, [keys[p] for p in train], [index.labels[p] for p in train],
                         [keys[p] for p in val], [index.labels[p] for p in val])
    return side(train), side(val), record


def index_from_record(record: dict, side: str, base: Path, classes: list[str]) -> ImageIndex:
    """The `side` ('train' or 'val') of a saved split, its paths resolved under `base` (which may be another
    machine's copy of the data)."""
    base = Path(base)
    return ImageIndex(base, list(classes), [str(base / key) for key in record[side]],
                            list(record[f"{side}_labels"]))


def write_split_lists(run_dir: Path, record: SplitRecord, classes: list[str], label_name=None) -> list[Path]:
    """split_train.csv and split_val.csv (columns path,label; paths relative to data.root) in the run
    directory: the split readable by people, and usable again as `data.format: csv` lists. `label_name`:
    a label as written (default its class name; a multi-label index joins the tags)."""
    label_name = label_name or (lambda label: classes[label])
    written = []
    for side in ("train", "val"):
        path = Path(run_dir) / f"split_{side}.csv"
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["path", "label"])
            writer.writerows((key, label_name(label)) for key, label in
                             zip(getattr(record, side), getattr(record, f"{side}_labels")))
        written.append(path)
    return written
