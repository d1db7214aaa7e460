"""Pure functions for batch arithmetic and the learning-rate schedule (warmup, then cosine)."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from core.errors import ConfigError

log = logging.getLogger("train")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def effective_batch(batch_size: int, accum_steps: int, world_size: int) -> int:
    return batch_size * accum_steps * world_size


def scaled_lr(lr: float, effective: int, base_batch_size: int, rule: str) -> float:
    """Peak LR for an effective batch, given `lr` at `base_batch_size`."""
    ratio = effective / base_batch_size
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    if rule == "none":
        return lr
    raise ValueError(f"unknown lr scaling rule {rule!r}")


def steps_per_epoch(batches_per_epoch: int, accum_steps: int) -> int:
    """Optimizer steps in an epoch; a shorter last accumulation window still makes a step."""
    return math.ceil(batches_per_epoch / accum_steps)


def window_length(batch_index: int, batches_per_epoch: int, accum_steps: int) -> int:
    """How many micro-batches the accumulation window holding `batch_index` has (the last may be short)."""
    start = (batch_index // accum_steps) * accum_steps
    return min(accum_steps, batches_per_epoch - start)


def warmup_steps(warmup_epochs: float, steps_in_epoch: int) -> int:
    """Warmup length in optimizer steps, rounded half up; any warmup asked for lasts at least one step."""
    if warmup_epochs <= 0:
        return 0
    return max(1, math.floor(warmup_epochs * steps_in_epoch + 0.5))


def lr_factor(step: int, warmup: int, total: int, start_factor: float = 0.0, min_ratio: float = 0.0) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based; the LR used by that step).

    Linear warmup from `start_factor` over `warmup` steps reaching 1.0 at step `warmup`, then a cosine
    from 1.0 down to `min_ratio` at step `total`.
    """
    if warmup > 0 and step < warmup:
        return start_factor + (1.0 - start_factor) * (step + 1) / (warmup + 1)
    decay_steps = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class WarmupCosine:
    """Picklable-free LR lambda for `LambdaLR`; its fields are plain numbers, so its state saves safely."""

    warmup: int
    total: int
    start_factor: float = 0.0
    min_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.warmup, self.total, self.start_factor, self.min_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, warmup: int, total: int, start_factor: float,
                    min_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup, total, start_factor, min_ratio))


@dataclass
class RunPlan:
    """The run's batch and step arithmetic, fixed at start-up (the start-up line prints it)."""

    batch_size: int            # per process
    accum_steps: int
    world_size: int
    batches_per_epoch: int     # per process, after data.limit_train_batches
    effective_batch: int
    peak_lr: float
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int


def plan_run(cfg, batch_size: int, batches_in_split: int, world_size: int) -> RunPlan:
    """RunPlan for `cfg` at a per-process `batch_size` whose sampler yields `batches_in_split` batches.
    ConfigError (exit 2) when `schedule.min_lr` lies above the scaled peak LR."""
    batches = min(batches_in_split, cfg.data.limit_train_batches or batches_in_split)
    accum = cfg.train.accum_steps
    if accum > batches:
        # A window longer than the epoch would end at the epoch's last batch anyway: say what happens.
        log.warning("train.accum_steps=%d is more than the %d batches of an epoch; accumulating %d instead "
                    "(one optimizer step per epoch, effective batch %d)", accum, batches, batches,
                    effective_batch(batch_size, batches, world_size))
        accum = batches
    effective = effective_batch(batch_size, accum, world_size)
    peak = scaled_lr(cfg.optim.lr, effective, cfg.optim.base_batch_size, cfg.optim.lr_scaling)
    if cfg.schedule.min_lr > peak:
        raise ConfigError(f"'schedule.min_lr' = {cfg.schedule.min_lr} is above the peak LR {peak:.6g} "
                          f"(optim.lr {cfg.optim.lr} with {cfg.optim.lr_scaling} scaling to effective batch "
                          f"{effective}); lower schedule.min_lr")
    per_epoch = steps_per_epoch(batches, accum)
    total = per_epoch * cfg.train.epochs
    warmup = min(warmup_steps(cfg.schedule.warmup_epochs, per_epoch), total)
    return RunPlan(batch_size, accum, world_size, batches, effective, peak, per_epoch, total, warmup)
