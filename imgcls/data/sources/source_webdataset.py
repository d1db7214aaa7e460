"""`data.format: webdataset`: tar shards (`data.train_shards`, `data.val_shards`) read as streams; the classes
come from `data.classes`."""
from __future__ import annotations

import logging
from pathlib import Path

from imgcls.data.labels import label_format
from imgcls.data.listing import read_class_list
from imgcls.data.shards import shard_index
from imgcls.data.sources.base import DataSources, EvalSource, Source

log = logging.getLogger(__name__)


def scan_webdataset(d) -> DataSources:
    classes = read_class_list(Path(d.classes).expanduser())
    labels = label_format(d)
    train = shard_index(d.train_shards, classes, d.train_samples, "data.train_shards", d.max_bad_fraction, labels)
    if d.train_samples is None:
        log.info("set data.train_samples=%d to skip counting the training shards at start", train.total)
    val = shard_index(d.val_shards, classes, None, "data.val_shards", d.max_bad_fraction, labels)
    identity = {"format": "webdataset", "train_shards": [Path(url).name for url in train.urls],
                "train_samples": train.total, "loader_workers": max(1, d.num_workers)}
    return DataSources(train, val, None, identity)


def listed(d, classes: list[str], spec) -> EvalSource:
    """Shards to evaluate: eval.py --data SHARDS.tar, or the checkpoint's data.val_shards."""
    return EvalSource(shard_index(spec, classes, None, "shards", d.max_bad_fraction, label_format(d)), str(spec),
                      "shards", str(spec))


SOURCE = Source("webdataset", scan_webdataset, lambda d, classes: listed(d, classes, d.val_shards),
                list_suffix=".tar", listed=listed)
