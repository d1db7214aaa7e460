"""What a source of samples answers (`Source`), and what scanning the configured one gives (`DataSources`,
`EvalSource`): training and validation indexes, where relative paths resolve, which list files eval.py --data
can name."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from imgcls.data.listing import ImageIndex, SplitRecord
from imgcls.data.shards import ShardIndex


@dataclass
class DataSources:
    train_index: ImageIndex | ShardIndex
    val_index: ImageIndex | ShardIndex
    split: Optional[SplitRecord] = None
    identity: dict = field(default_factory=dict)  # what last.pt / best.pt record as `data_source`

    @property
    def classes(self) -> list[str]:
        return self.train_index.classes


@dataclass
class EvalSource:
    index: ImageIndex | ShardIndex
    data: str        # the data root or list evaluated
    split: str       # the split's name: a folder name, 'held_out' (a data.val_fraction split), 'csv', 'shards'
    described: str   # for people


@dataclass(frozen=True)
class Source:
    name: str                                  # the data.format value
    scan: Callable                             # (data cfg) -> DataSources
    validation: Callable                       # (data cfg, classes) -> EvalSource: a checkpoint's own validation data
    base: Optional[Callable] = None            # (data cfg) -> Path where a recorded split's paths resolve
    list_suffix: Optional[str] = None          # the suffix of a list eval.py --data may name (.csv, .tar)
    listed: Optional[Callable] = None          # (data cfg, classes, that list) -> EvalSource
