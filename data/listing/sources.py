"""Where the labelled samples come from (`data.format`), behind one interface: `scan_sources(cfg)` gives the
training and validation indexes and the identity of the source (what the checkpoint records, so that a
resumed run can refuse other data and eval.py can find the held-out files again).

- `folder`: `<data.root>/<train_split>/` and `<data.root>/<val_split>/`, or with `data.val_fraction` the one
  class-folder tree `<data.root>/`, split.
- `csv`: `data.train_csv` and `data.val_csv` (or `data.val_fraction` of the training list).
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from core.errors import DataTreeError
from data.listing.csv_list import CsvRow, check_no_empty_classes, csv_index, read_class_list, read_csv_rows
from data.listing.folder import ImageIndex, match_classes, scan_split
from data.health import check_bad_fraction
from data.shards import ShardIndex, shard_index
from data.listing.split import SplitRecord, index_from_record, relative_key, split_index
from data.listing.tag_split import split_tag_index, tag_index_from_record
from data.listing.tags import check_tag_names, tag_classes, tag_csv_index

log = logging.getLogger(__name__)


@dataclass
class DataSources:
    train_index: ImageIndex | ShardIndex
    val_index: ImageIndex | ShardIndex
    split: Optional[SplitRecord] = None
    identity: dict = field(default_factory=dict)  # what last.pt / best.pt record as `data_source`

    @property
    def classes(self) -> list[str]:
        return self.train_index.classes


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
                         allow_empty_label=d.task == "multilabel")


def load_csv_list(d, csv_path: str, rows: list[CsvRow], classes: list[str], known_as: str,
                  split: str) -> ImageIndex:
    """One CSV list as an index; rows naming missing files are listed, counted and left out, and above
    `data.max_bad_fraction` of the list they stop the run (BadDataError, exit 1) before any training."""
    if d.task == "multilabel":
        index, missing = tag_csv_index(csv_path, csv_base(d, csv_path), rows, classes, known_as, d.label_delimiter)
    else:
        index, missing = csv_index(csv_path, csv_base(d, csv_path), rows, classes, known_as)
    if missing:
        log.warning("%s list %s: %d of %d row(s) name files that do not exist, left out: %s", split, csv_path,
                    len(missing), len(rows), ", ".join(missing[:20]) + (", ..." if len(missing) > 20 else ""))
    if split == "training":
        check_no_empty_classes(csv_path, index, missing)
    if missing:
        check_bad_fraction(missing, len(rows), f"{split} (missing, from {csv_path})", d.max_bad_fraction)
    return index


def csv_classes(d, train_rows: list[CsvRow]) -> tuple[list[str], str]:
    """The class list of a CSV source and how to name it in messages: `data.classes`, or the sorted set of
    the training list's labels."""
    if d.classes:
        names = read_class_list(Path(d.classes).expanduser())
        if d.task == "multilabel":
            check_tag_names(names, f"'data.classes' = {d.classes}")
        return names, f"classes in {d.classes}"
    if d.task == "multilabel":
        return tag_classes(train_rows, d.label_delimiter, f"CSV list {d.train_csv}"), "tags of the training list"
    return sorted({row.label for row in train_rows}), "training labels"


def scan_csv(d) -> DataSources:
    rows = read_list(d, d.train_csv)
    classes, known_as = csv_classes(d, rows)
    train = load_csv_list(d, d.train_csv, rows, classes, known_as, "training")
    base = csv_base(d, d.train_csv)
    identity = {"format": "csv", "train_csv_sha256": index_digest(train, base)}
    if d.val_fraction is not None:
        split = split_tag_index if d.task == "multilabel" else split_index
        train, val, record = split(train, base, d.val_fraction, d.split_seed)
        return DataSources(train, val, record, identity | {"split": record.to_dict()})
    known_as = known_as if d.classes else "labels of the training list"
    val = load_csv_list(d, d.val_csv, read_list(d, d.val_csv), classes, known_as, "validation")
    identity["val_csv_sha256"] = index_digest(val, csv_base(d, d.val_csv))
    return DataSources(train, val, None, identity)


def scan_folder(d) -> DataSources:
    root = Path(d.root).expanduser()
    classes = read_class_list(Path(d.classes).expanduser()) if d.classes else None
    named = (f"the classes in data.classes ({d.classes})", "data.classes")
    if d.val_fraction is not None:
        whole = scan_split(root)
        if classes is not None:
            whole = match_classes(whole, classes, *named)
        train, val, record = split_index(whole, root, d.val_fraction, d.split_seed)
        return DataSources(train, val, record, {"format": "folder", "split": record.to_dict()})
    if classes is None:
        train = scan_split(root / d.train_split)
        val = scan_split(root / d.val_split, classes=train.classes)
    else:  # the label order of data.classes; each split must hold exactly those class folders
        train = match_classes(scan_split(root / d.train_split), classes, *named)
        val = match_classes(scan_split(root / d.val_split), classes, *named)
    return DataSources(train, val, None, {"format": "folder"})


def scan_webdataset(d) -> DataSources:
    classes = read_class_list(Path(d.classes).expanduser())
    multilabel = d.task == "multilabel"
    train = shard_index(d.train_shards, classes, d.train_samples, "data.train_shards", d.max_bad_fraction,
                        multilabel)
    if d.train_samples is None:
        log.info("set data.train_samples=%d to skip counting the training shards at start", train.total)
    val = shard_index(d.val_shards, classes, None, "data.val_shards", d.max_bad_fraction, multilabel)
    identity = {"format": "webdataset", "train_shards": [Path(url).name for url in train.urls],
                "train_samples": train.total, "loader_workers": max(1, d.num_workers)}
    return DataSources(train, val, None, identity)


def scan_sources(cfg) -> DataSources:
    d = cfg.data
    scan = {"csv": scan_csv, "webdataset": scan_webdataset}.get(d.format, scan_folder)
    sources = scan(d)
    classes = sources.train_index.classes
    if len(classes) < 2:
        raise DataTreeError(f"the training data holds one class ({classes[0]}): a classifier needs at "
                            f"least two classes to learn anything (it would reach loss 0 and top-1 100 by always "
                            f"answering '{classes[0]}'); add a folder (or label) per class")
    return sources


@dataclass
class EvalSource:
    index: ImageIndex | ShardIndex
    data: str        # the data root or list evaluated
    split: str       # the split's name: a folder name, 'held_out' (a data.val_fraction split), 'csv', 'shards'
    described: str   # for people


def eval_source(d, classes: list[str], data_source: Optional[dict], data_arg: Optional[str] = None,
                split: Optional[str] = None) -> EvalSource:
    """What eval.py evaluates, labelled in `classes` (the checkpoint's order): `--data LIST.csv`; `--split NAME`
    (a folder under the data root); else the checkpoint's own validation data: the held-out files of its
    `data.val_fraction` split, its `data.val_csv`, or `<data.root>/<data.val_split>/`. `--data ROOT`
    relocates the data root of any of these."""
    known_as = "checkpoint's classes"
    shards_arg = data_arg is not None and data_arg.lower().endswith(".tar")
    if shards_arg or (data_arg is None and split is None and d.format == "webdataset"):
        spec = data_arg if shards_arg else d.val_shards
        return EvalSource(shard_index(spec, classes, None, "shards", d.max_bad_fraction, d.task == "multilabel"),
                          str(spec), "shards", str(spec))
    if data_arg is not None and data_arg.lower().endswith(".csv"):
        index = load_csv_list(d, data_arg, read_list(d, data_arg), classes, known_as, "evaluation")
        return EvalSource(index, data_arg, "csv", data_arg)
    saved_split = (data_source or {}).get("split")
    if split is None and saved_split is not None:
        base = csv_base(d, d.train_csv) if d.format == "csv" else Path(d.root).expanduser()
        held_out = (tag_index_from_record(saved_split, "val", base, classes, d.label_delimiter)
                    if d.task == "multilabel" else index_from_record(saved_split, "val", base, classes))
        return EvalSource(held_out, str(base), "held_out",
                          f"{base} (the files held out by data.val_fraction={saved_split['val_fraction']}, "
                          f"data.split_seed={saved_split['split_seed']})")
    if split is None and d.format == "csv":
        index = load_csv_list(d, d.val_csv, read_list(d, d.val_csv), classes, known_as, "validation")
        return EvalSource(index, d.val_csv, "csv", d.val_csv)
    root = Path(d.root).expanduser()
    split = split or d.val_split
    return EvalSource(match_classes(scan_split(root / split), classes), str(root), split, f"{root}/{split}")
