"""`data.format: csv`: `data.train_csv` and `data.val_csv` (or `data.val_fraction` of the training list); rows
name image files (relative to `data.root`, or to the CSV's folder) and their label (a class, or tags)."""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from imgcls.data.images import check_bad_fraction
from imgcls.data.labels import label_format
from imgcls.data.listing import CsvRow, ImageIndex, read_class_list, read_csv_rows, relative_key
from imgcls.data.sources.base import DataSources, EvalSource, Source

log = logging.getLogger(__name__)


def csv_base(d, csv_path: str) -> Path:
    """Where a CSV's relative paths resolve: `data.root`, or without it the CSV's own folder."""
    return Path(d.root).expanduser() if d.root else Path(csv_path).expanduser().parent


def index_digest(index: ImageIndex, base: Path) -> str:
    """SHA-256 of a list's (relative path, label name) rows: the same list of files on any machine."""
    h = hashlib.sha256()
    for path, label in zip(index.paths, index.labels):
        h.update(f"{relative_key(path, base)}\t{index.label_name(label)}\n".encode())
    return h.hexdigest()


def read_list(d, csv_path: str) -> list[CsvRow]:
    return read_csv_rows(Path(csv_path).expanduser(), d.csv_path_column, d.csv_label_column,
                         allow_empty_label=label_format(d).allows_empty_label)


def load_csv_list(d, csv_path: str, rows: list[CsvRow], classes: list[str], known_as: str,
                  split: str) -> ImageIndex:
    """One CSV list as an index; rows naming missing files are listed, counted and left out, and above
    `data.max_bad_fraction` of the list they stop the run (BadDataError, exit 1) before any training."""
    labels = label_format(d)
    index, missing = labels.csv_index(csv_path, csv_base(d, csv_path), rows, classes, known_as)
    if missing:
        log.warning("%s list %s: %d of %d row(s) name files that do not exist, left out: %s", split, csv_path,
                    len(missing), len(rows), ", ".join(missing[:20]) + (", ..." if len(missing) > 20 else ""))
    if split == "training":
        labels.check_every_class_present(csv_path, index, missing)
    if missing:
        check_bad_fraction(missing, len(rows), f"{split} (missing, from {csv_path})", d.max_bad_fraction)
    return index


def csv_classes(d, train_rows: list[CsvRow]) -> tuple[list[str], str]:
    """The class list of a CSV source and how to name it in messages: `data.classes`, or the sorted set of
    the training list's labels."""
    labels = label_format(d)
    if d.classes:
        names = labels.check_class_names(read_class_list(Path(d.classes).expanduser()), f"'data.classes' = {d.classes}")
        return names, f"classes in {d.classes}"
    return labels.classes_of(train_rows, f"CSV list {d.train_csv}"), labels.classes_from


def scan_csv(d) -> DataSources:
    rows = read_list(d, d.train_csv)
    classes, known_as = csv_classes(d, rows)
    train = load_csv_list(d, d.train_csv, rows, classes, known_as, "training")
    base = csv_base(d, d.train_csv)
    identity = {"format": "csv", "train_csv_sha256": index_digest(train, base)}
    if d.val_fraction is not None:
        train, val, record = label_format(d).split(train, base, d.val_fraction, d.split_seed)
        return DataSources(train, val, record, identity | {"split": record.to_dict()})
    known_as = known_as if d.classes else "labels of the training list"
    val = load_csv_list(d, d.val_csv, read_list(d, d.val_csv), classes, known_as, "validation")
    identity["val_csv_sha256"] = index_digest(val, csv_base(d, d.val_csv))
    return DataSources(train, val, None, identity)


def validation(d, classes: list[str]) -> EvalSource:
    index = load_csv_list(d, d.val_csv, read_list(d, d.val_csv), classes, "checkpoint's classes", "validation")
    return EvalSource(index, d.val_csv, "csv", d.val_csv)


def listed(d, classes: list[str], path: str) -> EvalSource:
    """eval.py --data LIST.csv."""
    index = load_csv_list(d, path, read_list(d, path), classes, "checkpoint's classes", "evaluation")
    return EvalSource(index, path, "csv", path)


SOURCE = Source("csv", scan_csv, validation, base=lambda d: csv_base(d, d.train_csv), list_suffix=".csv",
                listed=listed)
