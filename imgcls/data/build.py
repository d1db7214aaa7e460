"""From a config to datasets, samplers and loaders.

`data.mean` / `data.std` = auto: measured per channel on the training split, in one pass of the evaluation
preprocessing (no augmentation), before the run starts; the measured numbers replace `auto` in the run's config,
so the checkpoint's config and preprocessing carry them to eval.py, infer.py, serve.py and export.py. A resumed
run takes its first run's numbers."""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from imgcls.core.errors import BadDataError, ConfigError, ImageDecodeError
from imgcls.data.datasets import EvalDataset, TrainDataset, describe_failure
from imgcls.data.labels import TagIndex, describe_tags
from imgcls.data.listing import ImageIndex, ensure_builtin
from imgcls.data.loaders import (TrainSampler, build_eval_loader, build_stream_eval_loader, build_stream_train_loader,
                                 build_train_loader, shutdown_workers)
from imgcls.data.settings import MIN_STD, eval_size
from imgcls.data.shards import ShardEvalStream, ShardIndex, ShardTrainStream
from imgcls.data.sources import DataSources, scan_sources
from imgcls.data.transforms import EvalTransform, TrainTransform, auto_augment_policy

log = logging.getLogger(__name__)


@dataclass
class RunData:
    """What a training run reads: the training split with its sampler and loader, the validation split
    with its loader."""

    classes: list[str]
    train_index: ImageIndex | ShardIndex
    val_index: ImageIndex | ShardIndex
    sampler: TrainSampler | ShardTrainStream   # set_epoch(epoch, start_batch) and num_batches() either way
    train_loader: object
    val_loader: object
    sources: DataSources   # the source's identity and split, for the checkpoint and the run directory


def prepare_root(cfg) -> Path | None:
    if not cfg.data.root:  # CSV lists without a root: their paths resolve against their own folders
        return None
    root = Path(cfg.data.root).expanduser()
    if cfg.data.builtin:
        ensure_builtin(cfg.data.builtin, root)
    return root


def scan_splits(cfg) -> tuple[ImageIndex, ImageIndex]:
    """The training and validation indexes of whatever `data.format` names."""
    sources = scan_sources(cfg)
    return sources.train_index, sources.val_index


def eval_transform(data_cfg) -> EvalTransform:
    """The evaluation preprocessing of a config's `data` section (resize, centre crop, interpolation), at
    `data.eval_img_size` when set (FixRes: evaluate at another size than training)."""
    return EvalTransform(eval_size(data_cfg), data_cfg.crop_pct, data_cfg.interpolation, data_cfg.channels,
                         data_cfg.value_range)


def train_transform(data_cfg) -> TrainTransform:
    d = data_cfg
    policy = auto_augment_policy(d.auto_augment, d.auto_augment_magnitude, d.auto_augment_ops, d.interpolation)
    return TrainTransform(d.img_size, d.scale, d.ratio, d.hflip, d.color_jitter, d.interpolation, policy, d.channels,
                          d.value_range)


def describe_augmentation(data_cfg) -> list[str]:
    """Start-up lines for the data-side recipe knobs that are on (nothing when all are off)."""
    d = data_cfg
    lines = []
    if d.channels != 3 or d.value_range is not None:
        lines.append(f"data.channels={d.channels}: files read as {d.channels} float band(s), scaled by "
                     + (f"data.value_range={d.value_range}" if d.value_range is not None else "their sample type's "
                        "range") + f"; normalised per channel with mean {d.mean}, std {d.std}"
                     + (" (the ImageNet RGB values do not apply: auto, measured on the training split, unless "
                        "data.mean / data.std are set)"
                        if d.channels != 3 else ""))
    if d.auto_augment == "randaugment":
        lines.append(f"auto-augment: randaugment, {d.auto_augment_ops} ops at magnitude {d.auto_augment_magnitude}")
    elif d.auto_augment is not None:
        lines.append(f"auto-augment: {d.auto_augment}" + (f" (severity {d.auto_augment_magnitude}, clipped to 1..10)"
                                                          if d.auto_augment == "augmix" else ""))
    if d.repeated_augment > 1:
        lines.append(f"repeated augmentation x{d.repeated_augment}: each epoch takes 1/{d.repeated_augment} of the "
                     f"training images, each {d.repeated_augment} times with its own augmentation")
    if eval_size(d) != d.img_size:
        lines.append(f"training at {d.img_size} px, evaluating at {eval_size(d)} px "
                     f"(resize {eval_transform(d).resize_to}, centre crop)")
    return lines


def build_eval_loader_for(index, transform: EvalTransform, img_size: int, batch_size: int, num_workers: int,
                          pin_memory: bool, rank: int = 0, world_size: int = 1, persistent_workers: bool = False,
                          prefetch_factor: int = 2, limit_samples: int | None = None):
    """The evaluation loader of a split (a file index or a shard set): this rank's share, each sample once."""
    if isinstance(index, ShardIndex):
        stream = ShardEvalStream(index, transform, img_size, rank, world_size, limit_samples)
        return build_stream_eval_loader(stream, batch_size, num_workers, pin_memory, prefetch_factor)
    return build_eval_loader(EvalDataset(index, transform, img_size), batch_size, num_workers, pin_memory, rank,
                             world_size, persistent_workers=persistent_workers, prefetch_factor=prefetch_factor,
                             limit_samples=limit_samples)


def build_train_stream(cfg, index: ShardIndex, transform, batch_size: int, rank: int, world_size: int,
                       pin_memory: bool) -> tuple[ShardTrainStream, object]:
    """A shard set's training stream (which is also the run's sampler) and its loader."""
    d = cfg.data
    stream = ShardTrainStream(index, transform, cfg.train.seed, batch_size, rank, world_size, d.num_workers,
                              d.shuffle_buffer, shuffle=d.sampler != "sequential")
    return stream, build_stream_train_loader(stream, batch_size, d.num_workers, pin_memory, d.prefetch_factor)


def build_run_data(cfg, batch_size: int, rank: int, world_size: int, pin_memory: bool, scan=None) -> RunData:
    """`scan`: the config's scan of its data (`data.sources.scan_sources` unless a run labels its data itself: a
    class-incremental run's union of classes)."""
    sources = (scan or scan_sources)(cfg)
    train_index, val_index = sources.train_index, sources.val_index
    d = cfg.data
    transform = train_transform(d)
    for line in describe_augmentation(d):
        log.info(line)
    for name, index in (("training", train_index), ("validation", val_index)):
        if isinstance(index, TagIndex):
            log.info("%s: %s", name, describe_tags(index))
    if d.sampler == "sequential":
        log.warning("data.sampler=sequential: the training split is read in a fixed order every epoch; the loss "
                    "will cycle with the class order. Use data.sampler=random (or weighted) unless you mean it.")
    if isinstance(train_index, ShardIndex):
        sampler, train_loader = build_train_stream(cfg, train_index, transform, batch_size, rank, world_size,
                                                   pin_memory)
    else:
        sampler = TrainSampler(train_index.labels, d.sampler, cfg.train.seed, batch_size, rank, world_size,
                               repeats=d.repeated_augment)
        train_loader = build_train_loader(TrainDataset(train_index, transform), sampler, batch_size, d.num_workers,
                                          pin_memory, d.persistent_workers, d.prefetch_factor, cfg.train.seed)
    if sampler.num_batches() == 0:
        share = len(train_index) // world_size
        smaller = small_folder_batch(share)
        raise ConfigError(f"'train.batch_size' = {batch_size} is larger than this process's share of the training "
                          f"split ({share} images); lower it, e.g. train.batch_size={smaller} "
                          f"({share // smaller} batches per epoch)")
    val_limit = d.limit_val_batches * batch_size if d.limit_val_batches else None
    val_loader = build_eval_loader_for(val_index, eval_transform(d), eval_size(d), batch_size, d.num_workers,
                                       pin_memory, rank, world_size, d.persistent_workers, d.prefetch_factor,
                                       val_limit)
    return RunData(train_index.classes, train_index, val_index, sampler, train_loader, val_loader, sources)


def small_folder_batch(images: int) -> int:
    """A batch size for a split of `images` images that gives at least four batches per epoch: the largest
    power of two at most a quarter of them (1 for fewer than 8 images)."""
    batch = 1
    while batch * 2 <= images // 4:
        batch *= 2
    return batch


AUTO = "auto"


def wants_measuring(data_cfg) -> bool:
    return data_cfg.mean == AUTO or data_cfg.std == AUTO


def measure_channels(index, data_cfg, batch_size: int, num_workers: int) -> tuple[list[float], list[float], int, str]:
    """(mean, std, images, why the first unreadable file is) per channel of the split `index` on the [0, 1] scale,
    over every pixel of each readable image's evaluation crop; float64 sums, so memory is one batch whatever the
    split's size. Unreadable files (a band count other than data.channels, non-finite samples) are left out."""
    loader = build_eval_loader_for(index, eval_transform(data_cfg), eval_size(data_cfg), batch_size, num_workers,
                                   pin_memory=False)
    total = torch.zeros(data_cfg.channels, dtype=torch.float64)
    squares = torch.zeros(data_cfg.channels, dtype=torch.float64)
    pixels, images, first_unreadable = 0, 0, None
    try:
        for batch in loader:
            if first_unreadable is None and not bool(batch[2].all()):
                first_unreadable = int(batch[3][~batch[2]][0])
            x = batch[0][batch[2]].to(torch.float64) / 255.0
            total += x.sum(dim=(0, 2, 3))
            squares += (x * x).sum(dim=(0, 2, 3))
            pixels += x.shape[0] * x.shape[2] * x.shape[3]
            images += x.shape[0]
    finally:
        shutdown_workers(loader)
    problem = "" if first_unreadable is None else unreadable_reason(index, data_cfg, first_unreadable)
    if not pixels:
        return [0.5] * data_cfg.channels, [0.25] * data_cfg.channels, 0, problem
    mean = total / pixels
    std = (squares / pixels - mean * mean).clamp_min(0).sqrt()
    return ([float(m) for m in mean], [max(MIN_STD, float(s)) for s in std], images, problem)


def unreadable_reason(index, data_cfg, position: int) -> str:
    """Why sample `position` of `index` did not read: the file read again (a shard keeps no file to read again)."""
    if isinstance(index, ShardIndex):
        return "a broken sample in the training shards"
    path = index.paths[position]
    try:
        eval_transform(data_cfg)(path)
    except (ImageDecodeError, OSError) as err:
        return f"{path}: {describe_failure(path, err)}"
    return f"{path}: could not be read (it reads now)"


def no_image_measured(data_cfg, problem: str) -> Exception:
    """The error for an `auto` normalisation that found not one readable training image: a ConfigError naming
    data.channels when the files hold another number of bands, else a BadDataError."""
    text = (f"data.mean / data.std = auto: not one training image could be read with data.channels="
            f"{data_cfg.channels}, so there is nothing to measure; the first: {problem or 'no files'}")
    return ConfigError(text + " (set data.channels to the files' band count)") if "data.channels asks" in problem \
        else BadDataError(text)


def resolve_normalisation(cfg, index, resume_ckpt, batch_size: int, is_main_fn):
    """`cfg` with `auto` mean / std replaced: by the resumed run's numbers, or measured on `index` (the training
    split) by `is_main_fn` (a callable that runs a function on rank 0 and shares its result). Logs the choice."""
    d = cfg.data
    if not wants_measuring(d):
        return cfg
    saved = ((resume_ckpt or {}).get("config") or {}).get("data") or {}
    if isinstance(saved.get("mean"), list) and isinstance(saved.get("std"), list):
        mean, std = saved["mean"], saved["std"]
        log.info("data.mean / data.std = auto: the resumed run's measured values, mean %s, std %s",
                 _short(mean), _short(std))
    else:
        mean, std, images, problem = is_main_fn(lambda: measure_channels(index, d, batch_size, d.num_workers))
        if not images:
            raise no_image_measured(d, problem)
        if problem:
            log.warning("data.mean / data.std = auto: unreadable training files were left out of the measurement, "
                        "the first: %s", problem)
        log.info("data.mean / data.std = auto: measured per channel on %d training images (evaluation crops): "
                 "mean %s, std %s", images, _short(mean), _short(std))
    data = dataclasses.replace(d, mean=mean if d.mean == AUTO else d.mean, std=std if d.std == AUTO else d.std)
    return dataclasses.replace(cfg, data=data)


def resolve_class_weights(cfg, index):
    """`cfg` with `train.class_weights` checked against the training split's classes (a list of another length:
    ConfigError, exit 2) and `balanced` replaced by its numbers, from the split's file list (not from batches:
    the same on every rank and on a resume). Logs the weights."""
    from imgcls.tasks.losses import balanced_class_weights

    weights, classes = cfg.train.class_weights, index.classes
    if weights == "none":
        return cfg
    if isinstance(weights, list):
        if len(weights) != len(classes):
            raise ConfigError(f"'train.class_weights' has {len(weights)} weights; the training split has "
                              f"{len(classes)} classes ({_names(classes)}): one weight per class, in that order")
    elif isinstance(index, ShardIndex):
        raise ConfigError("'train.class_weights' = balanced counts the training split's labels, which shards hold "
                          "only inside their samples; give a list of weights in class order instead")
    else:
        weights = balanced_class_weights(torch.bincount(torch.tensor(index.labels, dtype=torch.long),
                                                        minlength=len(classes)).tolist())
    log.info("train.class_weights: %s", ", ".join(f"{c} {w:.4g}" for c, w in zip(classes, weights)))
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, class_weights=weights))


def _names(classes: list[str]) -> str:
    return ", ".join(classes[:8]) + (", ..." if len(classes) > 8 else "")


def for_timing(cfg):
    """`cfg` with `auto` mean / std replaced by 0.5 / 0.25 per channel: for runs that only measure what a step
    costs (the batch-size finder, benchmark.py), where the values change nothing."""
    d = cfg.data
    if not wants_measuring(d):
        return cfg
    mean = [0.5] * d.channels if d.mean == AUTO else d.mean
    std = [0.25] * d.channels if d.std == AUTO else d.std
    return dataclasses.replace(cfg, data=dataclasses.replace(d, mean=mean, std=std))


def _short(values) -> str:
    return "[" + ", ".join(f"{v:.6g}" if math.isfinite(v) else str(v) for v in values) + "]"
