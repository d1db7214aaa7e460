"""From a config to datasets, samplers and loaders."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from core.errors import ConfigError, DataTreeError
from data.builtin import ensure_builtin
from data.datasets import EvalDataset, TrainDataset
from data.folder import ImageFolderIndex, scan_split
from data.loaders import build_eval_loader, build_train_loader
from data.samplers import TrainSampler
from data.transforms import EvalTransform, TrainTransform

log = logging.getLogger("train")


@dataclass
class RunData:
    """What a training run reads: the training split with its sampler and loader, the validation split
    with its loader."""

    classes: list[str]
    train_index: ImageFolderIndex
    val_index: ImageFolderIndex
    sampler: TrainSampler
    train_loader: object
    val_loader: object


def prepare_root(cfg) -> Path:
    root = Path(cfg.data.root).expanduser()
    if cfg.data.builtin:
        ensure_builtin(cfg.data.builtin, root)
    return root


def scan_tree(cfg) -> tuple[ImageFolderIndex, ImageFolderIndex]:
    root = Path(cfg.data.root).expanduser()
    train_index = scan_split(root / cfg.data.train_split)
    if len(train_index.classes) < 2:
        raise DataTreeError(f"{train_index.root} holds one class folder ({train_index.classes[0]}): a classifier "
                            f"needs at least two classes to learn anything (it would reach loss 0 and top-1 100 "
                            f"by always answering '{train_index.classes[0]}'); add a folder per class")
    val_index = scan_split(root / cfg.data.val_split, classes=train_index.classes)
    return train_index, val_index


def eval_transform(data_cfg) -> EvalTransform:
    """The evaluation preprocessing of a config's `data` section (resize, centre crop, interpolation)."""
    return EvalTransform(data_cfg.img_size, data_cfg.crop_pct, data_cfg.interpolation)


def build_run_data(cfg, batch_size: int, rank: int, world_size: int, pin_memory: bool) -> RunData:
    train_index, val_index = scan_tree(cfg)
    d = cfg.data
    transform = TrainTransform(d.img_size, d.scale, d.ratio, d.hflip, d.color_jitter, d.interpolation)
    train_dataset = TrainDataset(train_index, transform)
    val_dataset = EvalDataset(val_index, eval_transform(d), d.img_size)
    if d.sampler == "sequential":
        log.warning("data.sampler=sequential: the training split is read in a fixed order every epoch; the loss "
                    "will cycle with the class order. Use data.sampler=random (or weighted) unless you mean it.")
    sampler = TrainSampler(train_index.labels, d.sampler, cfg.train.seed, batch_size, rank, world_size)
    if sampler.num_batches() == 0:
        raise ConfigError(f"'train.batch_size' = {batch_size} is larger than this process's share of the training "
                          f"split ({len(sampler.shuffler)} images); lower it")
    train_loader = build_train_loader(train_dataset, sampler, batch_size, d.num_workers, pin_memory,
                                      d.persistent_workers, d.prefetch_factor, cfg.train.seed)
    val_limit = d.limit_val_batches * batch_size if d.limit_val_batches else None
    val_loader = build_eval_loader(val_dataset, batch_size, d.num_workers, pin_memory, rank, world_size,
                                   persistent_workers=d.persistent_workers, prefetch_factor=d.prefetch_factor,
                                   limit_samples=val_limit)
    return RunData(train_index.classes, train_index, val_index, sampler, train_loader, val_loader)
