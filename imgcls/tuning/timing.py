"""Timing real training steps (the batch-size finder and benchmark.py): the loop the trainer runs, on
batches from a loader or a synthetic batch already on the device."""
from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from typing import Iterable

import torch

from imgcls.training.loop import measuring_parts, train_one_epoch
from imgcls.runtime.memory import current_memory_bytes, peak_memory_bytes, reset_peak_memory
from imgcls.rundir.state import EpochCounters, TrainState
from imgcls.training.step import TrainStep


def process_tree_cpu_seconds() -> float:
    """CPU time (user + system) of this process plus its children (loader workers), live ones and those that
    ended (a shard stream's workers end with each epoch). On a busy machine wall-clock rates follow the
    load of other processes; CPU seconds per image do not."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    me = os.getpid()
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:  # ppid; then utime, stime are fields 14, 15 of the whole line
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_batch(batch_size: int, img_size: int, num_classes: int, device: torch.device, train: bool = True,
                    channels: int = 3):
    """Random uint8 images and labels already on the device, shaped like a loader batch (`channels` bands)."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch_size, channels, img_size, img_size), dtype=torch.uint8, generator=generator)
    targets = torch.randint(0, num_classes, (batch_size,), generator=generator)
    images, targets = images.to(device), targets.to(device)
    if train:
        return images, targets, torch.full((batch_size,), -1, dtype=torch.int64)
    return images, targets, torch.ones(batch_size, dtype=torch.bool), torch.arange(batch_size)


class TimedIterator:
    """Wraps batches and adds up the time spent waiting for the next one (the data wait)."""

    def __init__(self, batches: Iterable):
        self.batches = iter(batches)
        self.wait_s = 0.0

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self.batches)
        finally:
            self.wait_s += time.perf_counter() - start


@dataclass
class StepTiming:
    steps: int
    images: int
    total_s: float
    data_wait_s: float
    peak_memory_bytes: int
    cpu_s: float = 0.0
    held_before_bytes: int = 0    # memory held when the timed steps started (peak minus it: what they added)

    @property
    def img_per_s(self) -> float:
        return self.images / self.total_s if self.total_s > 0 else 0.0

    @property
    def step_s(self) -> float:
        return self.total_s / max(self.steps, 1)


def time_train_steps(step: TrainStep, batches: Iterable, steps: int, warmup: int) -> StepTiming:
    """Run `warmup` then `steps` real training steps (`train_one_epoch`) on `batches`; time the latter."""
    iterator = iter(batches)
    device = step.input.device
    if warmup:
        train_one_epoch(step, measuring_parts(), iterator, warmup, TrainState(), EpochCounters())
    sync(device)
    reset_peak_memory(device)
    held_before = current_memory_bytes(device)
    timed = TimedIterator(iterator)
    counters = EpochCounters()
    cpu_start = process_tree_cpu_seconds()
    start = time.perf_counter()
    # train_one_epoch ends with one host sync (the epoch's loss sum), so the clock stops after the work.
    train_one_epoch(step, measuring_parts(), timed, steps, TrainState(), counters)
    sync(device)
    total = time.perf_counter() - start
    return StepTiming(steps, counters.samples, total, timed.wait_s, peak_memory_bytes(device),
                      process_tree_cpu_seconds() - cpu_start, held_before)
