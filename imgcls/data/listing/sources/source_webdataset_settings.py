"""The keys of data.format=webdataset (data/listing/sources/source_webdataset.py): tar shards read as a stream."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from imgcls.core.errors import ConfigError
from imgcls.core.settings import setting


@dataclass
class WebDatasetSourceKeys:
    FORMAT = "webdataset"
    FORMAT_HELP = "tar shards"

    # Shard locations may move on --resume (the checkpoint records the shard names and the sample count).
    train_shards: Union[str, list[str], None] = setting(
        None, "webdataset: training shards, a brace pattern (train-{000000..000127}.tar), a list, pipe: or "
              "http(s):// URLs", resume_free=True)
    val_shards: Union[str, list[str], None] = setting(
        None, "webdataset: validation shards (each sample counted once at any world size)", resume_free=True)
    shuffle_buffer: int = setting(1000, "webdataset: in-memory sample shuffle buffer per loader worker (shards "
                                        "are shuffled per epoch too; 0: off)", lo=0)
    train_samples: Optional[int] = setting(None, "webdataset: the epoch length in samples (null: count the "
                                                 "training shards' samples at start)", lo=1)

    def check_source(self) -> None:
        missing = [f"data.{k}" for k in ("train_shards", "val_shards", "classes") if not getattr(self, k)]
        if missing:
            raise ConfigError(f"'data.format' = webdataset needs {', '.join(missing)} (shard patterns such as "
                              f"train-{{000000..000127}}.tar, and the class list, one name per line)")
        if self.val_fraction is not None:
            raise ConfigError("'data.val_fraction' does not apply to shards: write the validation samples as their "
                              "own shards (data.val_shards)")
        if self.sampler == "weighted":
            raise ConfigError("'data.sampler' = weighted needs random access to every sample; a shard stream reads "
                              "in sequence. Use data.sampler=random with data.format=webdataset, or write "
                              "class-balanced shards")
        if self.repeated_augment > 1:
            raise ConfigError(f"'data.repeated_augment' = {self.repeated_augment} needs random access to every "
                              f"sample; a shard stream reads each sample once per epoch. Use "
                              f"data.repeated_augment=1 with data.format=webdataset")

    def check_unselected(self) -> None:
        if self.train_shards or self.val_shards:
            raise ConfigError(f"'data.train_shards' / 'data.val_shards' are set but 'data.format' = {self.format}; "
                              f"set data.format=webdataset to train from shards")
