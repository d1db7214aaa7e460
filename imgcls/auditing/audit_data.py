"""The labelled images an audit reads, named as training names them.

The splits come from `data.sources.scan_sources` (the training and validation indexes of every
`data.format`, with the same hidden-file rules, file checks and class list), plus `<data.root>/test/` when a
class-folder tree has one. Files are named by their path relative to the data root (or, for CSV lists without
one, to the list's folder); shard samples as training names them, "SHARD (sample N)". Shard samples are
copied byte for byte into a scratch folder so that every later phase (hashing, the K-fold runs, thumbnails)
reads files; the data itself is never written.

`data.unlabeled` (semi-supervised training) is listed apart (`unlabeled_items`, split "unlabeled", no label), as
data/unlabeled.py lists it: its files by their paths, shard members as "SHARD.tar/MEMBER" (copied to the scratch
folder like labelled shard samples). The audit looks in it only for copies of held-out images.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from imgcls.core.errors import DataTreeError
from imgcls.data.labels import label_format
from imgcls.data.listing import ImageIndex, relative_key, scan_split
from imgcls.data.shards import IMAGE_KEYS, POSITION_BITS, ShardIndex, read_shard, sample_image_and_label
from imgcls.data.sources import scan_sources
from imgcls.data.sources.source_csv import csv_base, read_list
from imgcls.data.unlabeled import ShardMembers, list_unlabeled

log = logging.getLogger("audit")

TEST_SPLIT = "test"
UNLABELED_SPLIT = "unlabeled"


@dataclass
class AuditItem:
    name: str    # as training names the file (relative to the data root), or "SHARD (sample N)"
    file: str    # where its bytes are on disk
    label: int
    split: str


@dataclass
class AuditData:
    classes: list[str]
    items: list[AuditItem]
    unreadable: list[dict] = field(default_factory=list)   # {"path", "split", "reason"} found while listing
    base: Path | None = None                                # what training-split names are relative to


def _file_items(index: ImageIndex, base: Path, split: str) -> list[AuditItem]:
    return [AuditItem(relative_key(p, base), p, label, split) for p, label in zip(index.paths, index.labels)]


def _skipped(index, base: Path, split: str) -> list[dict]:
    """Entries the folder scan left out (links out of the tree, FIFOs, ...), as "path (reason)"."""
    out = []
    for entry in getattr(index, "skipped", []) or []:
        path, _, reason = entry.partition(" (")
        out.append({"path": relative_key(path, base), "split": split, "reason": reason.rstrip(")")})
    return out


def _shard_items(index: ShardIndex, split: str, scratch: Path) -> tuple[list[AuditItem], list[dict]]:
    """Every sample of a shard set as a file in `scratch`; samples without a usable image or label are listed."""
    position = {name: i for i, name in enumerate(index.classes)}
    items, bad = [], []
    folder = scratch / split
    folder.mkdir(parents=True, exist_ok=True)
    for shard, url in enumerate(index.urls):
        for n, sample in enumerate(read_shard(url)):
            name = index.paths[(shard << POSITION_BITS) | n]
            try:
                image, label = sample_image_and_label(sample, position, index.labels)
                label = index.labels.as_listed(label)
            except ValueError as err:
                bad.append({"path": name, "split": split, "reason": str(err)})
                continue
            ext = next(k for k in IMAGE_KEYS if k in sample)
            target = folder / f"{shard:06d}-{n:09d}.{ext}"
            target.write_bytes(bytes(image))
            items.append(AuditItem(name, str(target), label, split))
    return items, bad


def unlabeled_items(d, scratch: Path) -> list[AuditItem]:
    """`data.unlabeled`'s images (label -1); ConfigError (exit 2) when it names none, as training says."""
    paths, _ = list_unlabeled(d)
    if not isinstance(paths, ShardMembers):
        return [AuditItem(path, path, -1, UNLABELED_SPLIT) for path in paths]
    scratch.mkdir(parents=True, exist_ok=True)
    items = []
    for i, name in enumerate(paths):
        target = scratch / f"{i:09d}.{Path(name).name.partition('.')[2]}"
        target.write_bytes(paths.read(i))
        items.append(AuditItem(name, str(target), -1, UNLABELED_SPLIT))
    return items


def _csv_missing(d, csv_path: str, classes: list[str], split: str) -> list[dict]:
    base = csv_base(d, csv_path)
    _, missing = label_format(d).csv_index(csv_path, base, read_list(d, csv_path), classes, "classes")
    return [{"path": relative_key(p, base), "split": split, "reason": "no such file (named in the CSV list)"}
            for p in missing]


def read_audit_data(cfg, scratch: Path) -> AuditData:
    """The training and validation splits (and a test split where the tree has one) of `cfg`'s data."""
    d = cfg.data
    sources = scan_sources(cfg)
    classes = sources.classes
    splits = {"train": sources.train_index, "val": sources.val_index}
    if d.format == "webdataset":
        data = AuditData(classes, [])
        for split, index in splits.items():
            items, bad = _shard_items(index, split, scratch)
            data.items += items
            data.unreadable += bad
        return data
    if d.format == "csv":
        base = csv_base(d, d.train_csv)
        data = AuditData(classes, [], base=base)
        data.items = _file_items(sources.train_index, base, "train")
        data.unreadable = _csv_missing(d, d.train_csv, classes, "train")
        val_base = base if d.val_fraction is not None else csv_base(d, d.val_csv)
        data.items += _file_items(sources.val_index, val_base, "val")
        if d.val_fraction is None:
            data.unreadable += _csv_missing(d, d.val_csv, classes, "val")
        return data
    root = Path(d.root).expanduser()
    data = AuditData(classes, [], base=root)
    for split, index in splits.items():
        data.items += _file_items(index, root, split)
        data.unreadable += _skipped(index, root, split)
    test = root / TEST_SPLIT
    if d.val_fraction is None and TEST_SPLIT not in (d.train_split, d.val_split) and test.is_dir():
        try:
            index = scan_split(test, classes=sorted(classes))
        except DataTreeError as err:
            log.warning("%s left out of the audit: %s", test, err)
        else:
            remap = [classes.index(name) for name in index.classes]
            index.labels = [remap[label] for label in index.labels]
            data.items += _file_items(index, root, TEST_SPLIT)
            data.unreadable += _skipped(index, root, TEST_SPLIT)
    return data
