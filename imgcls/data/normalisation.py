"""`data.mean` / `data.std` = auto: measured per channel on the training split, in one pass of the evaluation
preprocessing (no augmentation), before the run starts; the measured numbers replace `auto` in the run's config,
so the checkpoint's config and preprocessing carry them to eval.py, infer.py, serve.py and export.py. A resumed
run takes its first run's numbers."""
from __future__ import annotations

import dataclasses
import logging
import math

import torch

from imgcls.data.build import build_eval_loader_for, eval_transform
from imgcls.data.loaders import shutdown_workers
from imgcls.data.settings import MIN_STD, eval_size

log = logging.getLogger(__name__)
AUTO = "auto"


def wants_measuring(data_cfg) -> bool:
    return data_cfg.mean == AUTO or data_cfg.std == AUTO


def measure_channels(index, data_cfg, batch_size: int, num_workers: int) -> tuple[list[float], list[float], int]:
    """(mean, std, images) per channel of the split `index` on the [0, 1] scale, over every pixel of each
    readable image's evaluation crop; float64 sums, so memory is one batch whatever the split's size."""
    loader = build_eval_loader_for(index, eval_transform(data_cfg), eval_size(data_cfg), batch_size, num_workers,
                                   pin_memory=False)
    total = torch.zeros(data_cfg.channels, dtype=torch.float64)
    squares = torch.zeros(data_cfg.channels, dtype=torch.float64)
    pixels, images = 0, 0
    try:
        for batch in loader:
            x = batch[0][batch[2]].to(torch.float64) / 255.0
            total += x.sum(dim=(0, 2, 3))
            squares += (x * x).sum(dim=(0, 2, 3))
            pixels += x.shape[0] * x.shape[2] * x.shape[3]
            images += x.shape[0]
    finally:
        shutdown_workers(loader)
    if not pixels:
        return [0.5] * data_cfg.channels, [0.25] * data_cfg.channels, 0
    mean = total / pixels
    std = (squares / pixels - mean * mean).clamp_min(0).sqrt()
    return ([float(m) for m in mean], [max(MIN_STD, float(s)) for s in std], images)


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
        mean, std, images = is_main_fn(lambda: measure_channels(index, d, batch_size, d.num_workers))
        log.info("data.mean / data.std = auto: measured per channel on %d training images (evaluation crops): "
                 "mean %s, std %s", images, _short(mean), _short(std))
    data = dataclasses.replace(d, mean=mean if d.mean == AUTO else d.mean, std=std if d.std == AUTO else d.std)
    return dataclasses.replace(cfg, data=data)


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
