"""Where the labelled samples come from (`data.format`), registered in one place: each source is one module
(`source_folder.py`, `source_csv.py`, `source_webdataset.py`) with a `SOURCE` (`base.py` says what it answers),
and its config keys in data/settings.py. `scan_sources(cfg)` gives the training and validation indexes and the
identity of the source (what the checkpoint records, so that a resumed run can refuse other data and eval.py can
find the held-out files again); `eval_source` what eval.py evaluates."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Optional

import imgcls.data.sources.source_csv as source_csv
import imgcls.data.sources.source_folder as source_folder
import imgcls.data.sources.source_webdataset as source_webdataset
from imgcls.core.errors import DataTreeError
from imgcls.data.images import check_bad_fraction
from imgcls.data.labels import label_format
from imgcls.data.sources.base import DataSources, EvalSource, Source

log = logging.getLogger(__name__)


SOURCES: dict[str, Source] = {m.SOURCE.name: m.SOURCE for m in (source_folder, source_csv, source_webdataset)}


def scan_sources(cfg) -> DataSources:
    sources = SOURCES[cfg.data.format].scan(cfg.data)
    classes = sources.train_index.classes
    if len(classes) < 2:
        raise DataTreeError(f"the training data holds one class ({classes[0]}): a classifier needs at "
                            f"least two classes to learn anything (it would reach loss 0 and top-1 100 by always "
                            f"answering '{classes[0]}'); add a folder (or label) per class")
    return with_extra_training_rows(cfg.data, sources) if cfg.data.extra_train_csv else sources


def with_extra_training_rows(d, sources: DataSources) -> DataSources:
    """`data.extra_train_csv`'s rows (paths relative to the CSV's own folder; labels among the training classes)
    appended to the training split, after any data.val_fraction split, so they are never validated on; the list's
    digest joins the source's identity (a resume with other extra rows is another training)."""
    path = d.extra_train_csv
    base = Path(path).expanduser().parent
    rows = source_csv.read_list(d, path)
    train = sources.train_index
    extra, missing = label_format(d).csv_index(path, base, rows, train.classes, "training classes")
    if missing:
        log.warning("extra training list %s: %d of %d row(s) name files that do not exist, left out: %s", path,
                    len(missing), len(rows), ", ".join(missing[:20]) + (", ..." if len(missing) > 20 else ""))
        check_bad_fraction(missing, len(rows), f"extra training (missing, from {path})", d.max_bad_fraction)
    merged = dataclasses.replace(train, paths=train.paths + extra.paths, labels=train.labels + extra.labels)
    log.info("data.extra_train_csv: %d training image(s) added from %s (%d labelled before)", len(extra), path,
             len(train))
    identity = sources.identity | {"extra_train_csv_sha256": source_csv.index_digest(extra, base)}
    return dataclasses.replace(sources, train_index=merged, identity=identity)


def eval_source(d, classes: list[str], data_source: Optional[dict], data_arg: Optional[str] = None,
                split: Optional[str] = None) -> EvalSource:
    """What eval.py evaluates, labelled in `classes` (the checkpoint's order): `--data LIST` (a list file a
    source claims by its suffix: LIST.csv, SHARDS.tar); `--split NAME` (a folder under the data root); else
    the checkpoint's own validation data: the held-out files of its `data.val_fraction` split, or its
    source's validation data. `--data ROOT` relocates the data root of any of these."""
    if data_arg is not None:
        claimed = next((s for s in SOURCES.values() if s.list_suffix and data_arg.lower().endswith(s.list_suffix)),
                       None)
        if claimed is not None:
            return claimed.listed(d, classes, data_arg)
    saved_split = (data_source or {}).get("split")
    source = SOURCES[d.format]
    if split is None and saved_split is not None:
        base = source.base(d)
        return EvalSource(label_format(d).held_out(saved_split, "val", base, classes), str(base), "held_out",
                          f"{base} (the files held out by data.val_fraction={saved_split['val_fraction']}, "
                          f"data.split_seed={saved_split['split_seed']})")
    if split is None:
        return source.validation(d, classes)
    return source_folder.split_of(d, classes, split)


def train_source(d, classes: list[str], data_source: Optional[dict]) -> EvalSource:
    """The training data labelled in `classes` (eval.py --knn's memory bank, --linear-probe's fit set): the
    training side of a recorded data.val_fraction split, else the source's training data."""
    saved_split = (data_source or {}).get("split")
    source = SOURCES[d.format]
    if saved_split is not None:
        base = source.base(d)
        return EvalSource(label_format(d).held_out(saved_split, "train", base, classes), str(base), "train",
                          f"{base} (the training side of data.val_fraction={saved_split['val_fraction']})")
    if d.format == "folder":
        return source_folder.split_of(d, classes, d.train_split)
    index = source.scan(d).train_index
    if list(index.classes) != list(classes):
        raise DataTreeError(f"the training data's classes ({', '.join(index.classes[:5])} ...) are not the model's "
                            f"({', '.join(classes[:5])} ...)")
    return EvalSource(index, str(d.root), "train", f"the training data of data.format={d.format}")
