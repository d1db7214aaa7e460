"""A reproducible hold-out split of tagged files (`data.val_fraction` with `data.task: multilabel`):
iterative stratification (Sechidis et al. 2011, the `iterative-stratification` package), which keeps each
tag's share of positives close to the fraction on both sides, rarest tags first.

The split is a pure function of the files' relative paths, their tags, the fraction and the seed: the
files are first ordered by a SHA-256 of (seed, relative path), as data/listing/split.py orders them, and the
stratifier's own tie-breaking draws come from a numpy RandomState seeded with the seed (a generator whose
stream numpy keeps fixed). The input order therefore never depends on the listing order or the machine.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from imgcls.data.listing.split import SplitRecord, check_split_sides, relative_key
from imgcls.data.listing.labelling.tags import TagIndex


def tag_split_positions(keys: list[str], labels: list[tuple], num_classes: int, fraction: float, seed: int
                        ) -> tuple[list[int], list[int]]:
    """(training positions, validation positions) into `keys`, each in the input order."""
    from iterstrat.ml_stratifiers import MultilabelStratifiedShuffleSplit

    n = len(keys)
    if n < 2:
        check_split_sides(list(range(n)), [], fraction)
    order = sorted(range(n), key=lambda p: hashlib.sha256(f"{seed}\0{keys[p]}".encode()).digest())
    matrix = np.zeros((n, num_classes), dtype=np.int64)
    for row, p in enumerate(order):
        matrix[row, list(labels[p])] = 1
    held = max(1, min(n - 1, int(np.floor(n * fraction + 0.5))))
    splitter = MultilabelStratifiedShuffleSplit(n_splits=1, test_size=held, random_state=seed % 2**32)
    _, val_rows = next(splitter.split(np.zeros(n), matrix))
    val = sorted(order[r] for r in val_rows)
    held_out = set(val)
    return [p for p in range(n) if p not in held_out], val


def split_tag_index(index: TagIndex, base: Path, fraction: float, seed: int
                    ) -> tuple[TagIndex, TagIndex, SplitRecord]:
    """Split `index` (paths under `base`) into training and validation indexes and their record (labels as
    lists of class positions, what a checkpoint can hold)."""
    keys = [relative_key(p, base) for p in index.paths]
    train, val = tag_split_positions(keys, index.labels, len(index.classes), fraction, seed)
    check_split_sides(train, val, fraction)

    def side(positions):
        return TagIndex(index.root, list(index.classes), [index.paths[p] for p in positions],
                        [index.labels[p] for p in positions], delimiter=index.delimiter)

    record = SplitRecord(fraction, seed, [keys[p] for p in train], [list(index.labels[p]) for p in train],
                         [keys[p] for p in val], [list(index.labels[p]) for p in val])
    return side(train), side(val), record


def tag_index_from_record(record: dict, side: str, base: Path, classes: list[str], delimiter: str) -> TagIndex:
    """The `side` ('train' or 'val') of a saved multi-label split, its paths resolved under `base`."""
    base = Path(base)
    return TagIndex(base, list(classes), [str(base / key) for key in record[side]],
                    [tuple(label) for label in record[f"{side}_labels"]], delimiter=delimiter)
